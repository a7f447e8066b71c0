//! What a client reads of the gateway's answers, over real HTTP: refusals exactly
//! `{"detail": ...}` by default and also in the client protocol's own error object when the
//! operator turns that on; whether asking again can help (`x-should-retry`); the request id under
//! both names the SDKs read; and models called by an alias.

use crate::common;

use std::sync::Arc;

use common::fake_provider::{FakeProvider, Fault};
use common::*;
use model_gateway::{
    Catalogue, Credits, Upstream, catalogue::DEMO_CATALOGUE, error::ErrorBody,
    router::DEFAULT_MAX_BODY_BYTES, upstream::MockUpstream,
};
use serde_json::{Value, json};

/// An answer with its headers.
struct Seen {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Value,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|value| value.to_str().unwrap())
    }
}

async fn seen(request: reqwest::RequestBuilder) -> Seen {
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let bytes = response.bytes().await.unwrap();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| panic!("{status}: not JSON: {:?}", String::from_utf8_lossy(&bytes)));
    Seen {
        status,
        headers,
        body,
    }
}

/// The mock gateway on the demo catalogue, refusals with `body`.
async fn mock_gateway(db: &TestDb, body: ErrorBody) -> Gateway {
    let router = model_gateway::Gateway::new(
        db.store.clone(),
        Arc::new(Catalogue::demo()),
        Upstream::Mock(MockUpstream::new()),
    )
    .error_body(body)
    .router();
    serve_router(router).await
}

fn post(gateway: &Gateway, path: &str, key: &str, body: &str) -> reqwest::RequestBuilder {
    gateway
        .client
        .post(format!("{}{path}", gateway.base))
        .header("x-api-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
}

/// One refused request of each kind a client meets on a call endpoint, with its status and
/// detail. `poor` has 1 credit.
fn refusals<'a>(
    gateway: &'a Gateway,
    path: &'a str,
    model: &'a str,
    key: &'a str,
    poor: &'a str,
) -> Vec<(reqwest::RequestBuilder, u16, &'static str)> {
    let body = if path == MESSAGES {
        messages_body(model)
    } else {
        chat_body(model)
    };
    vec![
        (
            post(gateway, path, "sk-mg-wrong", &body),
            401,
            "无效的 API Key",
        ),
        (
            post(gateway, path, key, "not json"),
            400,
            "请求体不是有效的 JSON 对象",
        ),
        (
            post(gateway, path, key, &body.replace(model, "no-such-model")),
            404,
            "模型不存在",
        ),
        (post(gateway, path, poor, &body), 402, "积分不足"),
        (
            gateway
                .client
                .get(format!("{}{path}", gateway.base))
                .header("x-api-key", key),
            405,
            "不支持的请求方法",
        ),
    ]
}

#[tokio::test]
async fn refusals_are_exactly_detail_by_default_and_say_asking_again_cannot_help() {
    let db = local_db().await;
    let gateway = mock_gateway(&db, ErrorBody::Detail).await;
    let key = db.funded_key(100, 0).await;
    let poor = db.funded_key(1, 0).await;
    for (path, model) in [(CHAT, CHAT_MODEL), (MESSAGES, MESSAGES_MODEL)] {
        for (request, status, detail) in refusals(&gateway, path, model, &key, &poor) {
            let answer = seen(request).await;
            assert_eq!(answer.status, status, "{path}: {:?}", answer.body);
            assert_eq!(answer.body, json!({ "detail": detail }), "{path} {status}");
            assert_eq!(
                answer.header("x-should-retry"),
                Some("false"),
                "{path} {status}"
            );
            let id = answer.header("x-request-id").unwrap();
            assert!(id.starts_with("req_"), "{id}");
            assert_eq!(answer.header("request-id"), Some(id), "{path} {status}");
        }
    }
    assert_eq!(db.balance(&poor).await, balance(1, 0));
    assert!(db.calls(&key).await.is_empty() && db.calls(&poor).await.is_empty());
}

#[tokio::test]
async fn compatible_refusals_on_openai_paths_carry_openais_error_object() {
    let db = local_db().await;
    let gateway = mock_gateway(&db, ErrorBody::Compatible).await;
    let key = db.funded_key(100, 0).await;
    let poor = db.funded_key(1, 0).await;
    let types = [
        (401, "authentication_error", "invalid_api_key", None),
        (400, "invalid_request_error", "invalid_json", None),
        (404, "not_found_error", "model_not_found", Some("model")),
        (402, "insufficient_quota", "insufficient_quota", None),
        (405, "invalid_request_error", "method_not_allowed", None),
    ];
    let refused = refusals(&gateway, CHAT, CHAT_MODEL, &key, &poor);
    for ((request, status, detail), (expected, kind, code, param)) in refused.into_iter().zip(types)
    {
        assert_eq!(status, expected);
        let answer = seen(request).await;
        assert_eq!(answer.status, status);
        assert_eq!(
            answer.body,
            json!({
                "detail": detail,
                "error": { "message": detail, "type": kind, "code": code, "param": param },
            }),
            "{status}"
        );
        assert_eq!(answer.header("x-should-retry"), Some("false"));
    }
    // The key holders' endpoints and a path that does not exist answer in the same shape.
    let models = seen(
        gateway
            .client
            .get(format!("{}/v1/models", gateway.base))
            .bearer_auth("sk-mg-wrong"),
    )
    .await;
    assert_eq!(models.status, 401);
    assert_eq!(models.body["error"]["type"], "authentication_error");
    let unknown = seen(post(&gateway, "/v1/assistants", &key, "{}")).await;
    assert_eq!(unknown.status, 404);
    assert_eq!(unknown.body["detail"], "接口不存在");
    assert_eq!(unknown.body["error"]["message"], "接口不存在");
    assert_eq!(unknown.body["error"]["type"], "not_found_error");
    // The Responses endpoint refuses in OpenAI's shape too, naming the field.
    let no_input = seen(post(
        &gateway,
        "/v1/responses",
        &key,
        r#"{"model":"gpt-4o-mini"}"#,
    ))
    .await;
    assert_eq!(no_input.status, 400);
    assert_eq!(no_input.body["error"]["param"], "input");
    assert_eq!(no_input.body["error"]["type"], "invalid_request_error");
    assert_eq!(db.balance(&poor).await, balance(1, 0));
}

#[tokio::test]
async fn compatible_refusals_on_anthropic_paths_carry_anthropics_error_object() {
    let db = local_db().await;
    let gateway = mock_gateway(&db, ErrorBody::Compatible).await;
    let key = db.funded_key(100, 0).await;
    let poor = db.funded_key(1, 0).await;
    let types = [
        "authentication_error",
        "invalid_request_error",
        "not_found_error",
        "billing_error",
        "invalid_request_error",
    ];
    let refused = refusals(&gateway, MESSAGES, MESSAGES_MODEL, &key, &poor);
    for ((request, status, detail), kind) in refused.into_iter().zip(types) {
        let answer = seen(request).await;
        assert_eq!(answer.status, status);
        assert_eq!(
            answer.body,
            json!({
                "detail": detail,
                "type": "error",
                "error": { "type": kind, "message": detail },
            }),
            "{status}"
        );
    }
    // count_tokens is below /v1/messages; the model list answers an Anthropic SDK in its shape.
    let count = seen(post(
        &gateway,
        "/v1/messages/count_tokens",
        &key,
        r#"{"model":"no-such-model","messages":[]}"#,
    ))
    .await;
    assert_eq!(count.status, 404);
    assert_eq!(count.body["type"], "error");
    assert_eq!(count.body["error"]["type"], "not_found_error");
    let models = seen(
        gateway
            .client
            .get(format!("{}/v1/models", gateway.base))
            .header("x-api-key", "sk-mg-wrong")
            .header("anthropic-version", "2023-06-01"),
    )
    .await;
    assert_eq!(models.status, 401);
    assert_eq!(models.body["type"], "error");
    assert_eq!(models.body["error"]["type"], "authentication_error");
}

#[tokio::test]
async fn the_catalogue_can_turn_compatible_bodies_on_and_operators_paths_keep_detail() {
    let db = local_db().await;
    let catalogue =
        Catalogue::from_toml(&format!("error_body = \"compatible\"\n{DEMO_CATALOGUE}")).unwrap();
    let gateway = start_mock_gateway_with(&db, catalogue).await;
    let refused = seen(post(&gateway, CHAT, "sk-mg-wrong", &chat_body(CHAT_MODEL))).await;
    assert_eq!(refused.body["error"]["type"], "authentication_error");
    // Outside /v1/ (probes, the admin API, the console) scripts read `detail` alone.
    let admin = seen(
        gateway
            .client
            .get(format!("{}/admin/accounts", gateway.base)),
    )
    .await;
    assert_eq!(admin.status, 404);
    assert_eq!(admin.body, json!({ "detail": "接口不存在" }));
}

/// A provider with OpenAI's kind at `provider`, serving the demo chat model.
fn provider_catalogue(provider: &FakeProvider) -> Catalogue {
    Catalogue::from_toml(&one_upstream_toml("fake", &provider.base, "FAKE_KEY", "")).unwrap()
}

#[tokio::test]
async fn a_failed_upstream_says_retry_and_a_providers_refusal_of_the_request_says_not() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, provider_catalogue(&provider)).await;
    let key = db.funded_key(100, 0).await;

    provider.always(Fault::json(503, r#"{"error":{"message":"overloaded"}}"#));
    let failed = seen(post(&gateway, CHAT, &key, &chat_body(CHAT_MODEL))).await;
    assert_eq!(failed.status, 502);
    assert_eq!(failed.header("x-should-retry"), Some("true"));

    provider.always(Fault::json(
        400,
        r#"{"error":{"message":"max_tokens is too large","type":"invalid_request_error"}}"#,
    ));
    let rejected = seen(post(&gateway, CHAT, &key, &chat_body(CHAT_MODEL))).await;
    assert_eq!(rejected.status, 502);
    assert!(
        rejected.body["detail"]
            .as_str()
            .unwrap()
            .contains("max_tokens is too large")
    );
    assert_eq!(rejected.header("x-should-retry"), Some("false"));

    assert_eq!(db.balance(&key).await, balance(100, 0), "both refunded");
    db.assert_audit_holds().await;
}

/// The demo catalogue, its chat model also called `gpt-4o-mini-2024-07-18`.
fn demo_with_chat_alias() -> Catalogue {
    let toml = DEMO_CATALOGUE.replace(
        "name = \"gpt-4o-mini\"\n",
        "name = \"gpt-4o-mini\"\naliases = [\"gpt-4o-mini-2024-07-18\"]\n",
    );
    Catalogue::from_toml(&toml).unwrap()
}

#[tokio::test]
async fn a_call_by_alias_is_the_models_call_billed_and_logged_under_its_name() {
    let db = local_db().await;
    let gateway = start_gateway(
        &db,
        demo_with_chat_alias(),
        Upstream::Mock(MockUpstream::new()),
        DEFAULT_MAX_BODY_BYTES,
    )
    .await;
    let key = db.funded_key(100, 0).await;
    assert_eq!(
        gateway.chat(&key, "gpt-4o-mini-2024-07-18").await.status,
        200
    );
    assert_eq!(
        gateway
            .messages(&key, "claude-haiku-4-5-20251001")
            .await
            .status,
        200
    );
    assert_eq!(
        db.balance(&key).await,
        balance(100 - CHAT_PRICE - MESSAGES_PRICE, 0)
    );
    let mut calls = db.calls(&key).await;
    calls.sort_by_key(|call| call.id);
    let logged: Vec<_> = calls
        .iter()
        .map(|call| {
            (
                call.model.as_str(),
                call.requested_model.as_deref(),
                call.price.get(),
            )
        })
        .collect();
    assert_eq!(
        logged,
        [
            (CHAT_MODEL, Some("gpt-4o-mini-2024-07-18"), CHAT_PRICE),
            (
                MESSAGES_MODEL,
                Some("claude-haiku-4-5-20251001"),
                MESSAGES_PRICE
            ),
        ]
    );
    // By its own name, nothing is kept beside it; on the other protocol's endpoint an alias is
    // no more there than its model.
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    assert_eq!(db.calls(&key).await[0].requested_model, None);
    let crossed = gateway.chat(&key, "claude-haiku-4-5-20251001").await;
    assert_eq!((crossed.status, crossed.detail()), (404, "模型不存在"));
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_call_by_alias_reaches_the_provider_under_the_catalogue_or_channel_name() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    provider.always(Fault::json(200, r#"{"choices":[],"usage":{}}"#));
    let toml = format!(
        "{}\n[[models]]\nname = \"house\"\naliases = [\"house-latest\"]\nprotocol = \"chat_completions\"\nprice = 1\nupstream = \"fake\"\nupstream_model = \"qwen-7b\"\n",
        one_upstream_toml("fake", &provider.base, "FAKE_KEY", "").replace(
            &format!("name = \"{CHAT_MODEL}\"\n"),
            &format!("name = \"{CHAT_MODEL}\"\naliases = [\"mini\"]\n"),
        )
    );
    let gateway = http_gateway(&db, Catalogue::from_toml(&toml).unwrap()).await;
    let key = db.funded_key(100, 0).await;
    for (alias, upstream_name) in [("mini", CHAT_MODEL), ("house-latest", "qwen-7b")] {
        assert_eq!(gateway.chat(&key, alias).await.status, 200, "{alias}");
        let sent: Value = serde_json::from_slice(&provider.last().body).unwrap();
        assert_eq!(sent["model"], upstream_name, "{alias}");
        assert_eq!(
            sent["messages"],
            json!([{ "role": "user", "content": "Hello" }])
        );
    }
}

#[tokio::test]
async fn models_are_listed_by_catalogue_name_with_their_aliases() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(100, 0).await;
    let get = |path: &str, anthropic: bool| {
        let request = gateway
            .client
            .get(format!("{}{path}", gateway.base))
            .header("x-api-key", &key);
        if anthropic {
            request.header("anthropic-version", "2023-06-01")
        } else {
            request
        }
    };
    for anthropic in [false, true] {
        let list = seen(get("/v1/models", anthropic)).await;
        let items = list.body["data"].as_array().unwrap();
        let ids: Vec<_> = items
            .iter()
            .map(|item| item["id"].as_str().unwrap())
            .collect();
        assert!(!ids.iter().any(|id| id.ends_with("20251001")), "{ids:?}");
        let haiku = items
            .iter()
            .find(|item| item["id"] == MESSAGES_MODEL)
            .unwrap();
        assert_eq!(haiku["aliases"], json!(["claude-haiku-4-5-20251001"]));
        let chat = items.iter().find(|item| item["id"] == CHAT_MODEL).unwrap();
        assert_eq!(chat["aliases"], json!([]));
        assert_eq!(haiku["endpoints"], json!(["messages"]));
        assert_eq!(chat["endpoints"], json!(["chat_completions", "responses"]));
        let one = seen(get("/v1/models/claude-haiku-4-5-20251001", anthropic)).await;
        assert_eq!((one.status, &one.body["id"]), (200, &json!(MESSAGES_MODEL)));
    }
}

/// A model whose `endpoints` leave out Responses is not found there (404, nothing charged, no
/// entry), and answers on the endpoint it lists.
#[tokio::test]
async fn a_model_answers_only_on_the_endpoints_it_lists() {
    let db = local_db().await;
    let catalogue = Catalogue::from_toml(&format!(
        "{DEMO_CATALOGUE}\n[[models]]\nname = \"chat-only\"\nprotocol = \"chat_completions\"\n\
         endpoints = [\"chat_completions\"]\nprice = 1\nupstream = \"openai\"\n"
    ))
    .unwrap();
    let gateway = start_mock_gateway_with(&db, catalogue).await;
    let key = db.funded_key(0, 10).await;
    let body = json!({ "model": "chat-only", "input": "hi" }).to_string();
    let refused = gateway.post_bearer("/v1/responses", &key, body).await;
    assert_eq!(refused.status, 404);
    assert_eq!(refused.body, json!({ "detail": "模型不存在" }));
    assert_eq!(db.balance(&key).await.total(), Credits::new(10));
    assert!(db.calls(&key).await.is_empty());
    let answered = gateway.chat(&key, "chat-only").await;
    assert_eq!(answered.status, 200, "{:?}", answered.body);
    assert_eq!(db.balance(&key).await.total(), Credits::new(9));
}
