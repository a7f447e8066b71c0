//! The upstream path against a fake provider started by the test: what reaches the provider,
//! what comes back, and the refund of every kind of provider failure.

mod common;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, Uri};
use common::*;
use model_gateway::{CallStatus, Catalogue, HttpUpstream, Upstream};

/// What the fake provider saw of one request.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    headers: HeaderMap,
    body: Bytes,
}

/// What the fake provider does with the next request.
#[derive(Debug, Clone)]
enum Script {
    Reply(u16, &'static str),
    Delay(Duration, u16, &'static str),
}

#[derive(Clone, Default)]
struct FakeProvider {
    seen: Arc<Mutex<Vec<Seen>>>,
    script: Arc<Mutex<VecDeque<Script>>>,
}

impl FakeProvider {
    /// Starts the provider on an ephemeral port; returns it and its base URL.
    async fn start() -> (FakeProvider, String) {
        let provider = FakeProvider::default();
        let state = provider.clone();
        let app = axum::Router::new().fallback(move |uri: Uri, headers: HeaderMap, body: Bytes| {
            let state = state.clone();
            async move {
                state.seen.lock().unwrap().push(Seen {
                    path: uri.path().to_owned(),
                    headers,
                    body,
                });
                let next = state.script.lock().unwrap().pop_front();
                let (status, reply) = match next.expect("the test scripted a reply") {
                    Script::Reply(status, reply) => (status, reply),
                    Script::Delay(delay, status, reply) => {
                        tokio::time::sleep(delay).await;
                        (status, reply)
                    }
                };
                (
                    StatusCode::from_u16(status).unwrap(),
                    [("content-type", "application/json")],
                    reply,
                )
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (provider, base)
    }

    fn then(&self, script: Script) -> &Self {
        self.script.lock().unwrap().push_back(script);
        self
    }

    fn last_seen(&self) -> Seen {
        self.seen
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("the provider was called")
    }
}

const OPENAI_KEY: &str = "prov-openai-secret";
const ANTHROPIC_KEY: &str = "prov-anthropic-secret";

/// A catalogue with one model of each protocol on the fake provider.
fn catalogue(base: &str, timeout_secs: u64) -> Catalogue {
    Catalogue::from_toml(&format!(
        r#"
        [[upstreams]]
        name = "fake-openai"
        kind = "openai"
        base_url = "{base}/v1"
        api_key_env = "FAKE_OPENAI_KEY"
        timeout_secs = {timeout_secs}
        [[upstreams]]
        name = "fake-anthropic"
        kind = "anthropic"
        base_url = "{base}"
        api_key_env = "FAKE_ANTHROPIC_KEY"
        timeout_secs = {timeout_secs}
        [[models]]
        name = "{CHAT_MODEL}"
        protocol = "chat_completions"
        price = {CHAT_PRICE}
        upstream = "fake-openai"
        [[models]]
        name = "house-chat"
        protocol = "chat_completions"
        price = 1
        upstream = "fake-openai"
        upstream_model = "qwen2.5-7b-instruct"
        [[models]]
        name = "{MESSAGES_MODEL}"
        protocol = "messages"
        price = {MESSAGES_PRICE}
        upstream = "fake-anthropic"
        "#
    ))
    .unwrap()
}

struct Setup {
    db: TestDb,
    gateway: Gateway,
    provider: FakeProvider,
    key: String,
}

async fn setup(timeout_secs: u64) -> Setup {
    let (provider, base) = FakeProvider::start().await;
    let catalogue = catalogue(&base, timeout_secs);
    let upstream = HttpUpstream::with_keys(&catalogue, |variable| match variable {
        "FAKE_OPENAI_KEY" => Some(OPENAI_KEY.into()),
        "FAKE_ANTHROPIC_KEY" => Some(ANTHROPIC_KEY.into()),
        _ => None,
    })
    .unwrap();
    let db = sqlite_db().await;
    let gateway = start_gateway(&db, catalogue, Upstream::Http(upstream), 1 << 20).await;
    let key = db.funded_key(50, 50).await;
    Setup {
        db,
        gateway,
        provider,
        key,
    }
}

fn assert_no_header_carries(seen: &Seen, secret: &str) {
    for (name, value) in &seen.headers {
        assert!(
            !value.to_str().unwrap_or_default().contains(secret),
            "header {name} leaks the client's key"
        );
    }
}

// Odd spacing, key order, number formats and unknown fields: all must arrive byte for byte.
const CHAT_REQUEST: &str = r#"{"messages": [{"role":"system","content":"Be terse."},{"role":"user","content":[{"type":"text","text":"What is in this image? 你好"},{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo=","detail":"low"}}]}],
  "model":"gpt-4o-mini", "temperature": 0.70, "tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}],
  "tool_choice":"auto", "response_format":{"type":"json_object"}, "x_vendor_extension":{"n":1e2,"keep":[true,null]}}"#;

const CHAT_REPLY: &str = r#"{"id":"chatcmpl-abc","object":"chat.completion","created":1700000000,"model":"gpt-4o-mini-2024-07-18","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":57,"completion_tokens":15,"total_tokens":72},"system_fingerprint":"fp_x","vendor_extra":1.50}"#;

#[tokio::test]
async fn a_chat_request_reaches_the_provider_byte_for_byte_with_the_provider_key() {
    let s = setup(30).await;
    s.provider.then(Script::Reply(200, CHAT_REPLY));

    let answer = s
        .gateway
        .send(
            s.gateway
                .client
                .post(format!("{}{CHAT}", s.gateway.base))
                .bearer_auth(&s.key)
                .header("openai-organization", "org-123")
                .header("x-unrelated", "stays-here")
                .body(CHAT_REQUEST),
        )
        .await;

    assert_eq!(answer.status, 200);
    assert_eq!(
        answer.bytes,
        CHAT_REPLY.as_bytes(),
        "the reply must come back unchanged"
    );
    let seen = s.provider.last_seen();
    assert_eq!(seen.path, "/v1/chat/completions");
    assert_eq!(
        seen.body,
        CHAT_REQUEST.as_bytes(),
        "the request must arrive unchanged"
    );
    assert_eq!(
        seen.headers["authorization"],
        format!("Bearer {OPENAI_KEY}")
    );
    assert_eq!(seen.headers["openai-organization"], "org-123");
    assert!(seen.headers.get("x-unrelated").is_none());
    assert_no_header_carries(&seen, &s.key);

    let call = &s.db.calls(&s.key).await[0];
    assert_eq!(call.status, CallStatus::Ok);
    assert_eq!(
        (call.input_tokens, call.output_tokens),
        (Some(57), Some(15))
    );
}

const MESSAGES_REQUEST: &str = r#"{"model":"claude-haiku-4-5","max_tokens":1024,
 "system":[{"type":"text","text":"You are a weather bot.","cache_control":{"type":"ephemeral"}}],
 "tools":[{"name":"get_weather","description":"Weather by city","input_schema":{"type":"object","properties":{"city":{"type":"string"}}}}],
 "messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBORw0KGgo="}},{"type":"text","text":"Weather in Paris?"}]},
  {"role":"assistant","content":[{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{"city":"Paris"}}]},
  {"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"18°C, cloudy"}]}],
 "metadata":{"user_id":"u-42"},"temperature":0.5}"#;

const MESSAGES_REPLY: &str = r#"{"id":"msg_01","type":"message","role":"assistant","model":"claude-3-5-haiku-20241022","content":[{"type":"text","text":"It is 18°C and cloudy."},{"type":"tool_use","id":"toolu_2","name":"get_weather","input":{"city":"Lyon"}}],"stop_reason":"tool_use","stop_sequence":null,"usage":{"input_tokens":410,"output_tokens":33,"cache_read_input_tokens":0}}"#;

#[tokio::test]
async fn a_messages_request_reaches_the_provider_with_x_api_key_and_the_clients_headers() {
    let s = setup(30).await;
    s.provider.then(Script::Reply(200, MESSAGES_REPLY));

    let answer = s
        .gateway
        .send(
            s.gateway
                .client
                .post(format!("{}{MESSAGES}", s.gateway.base))
                .header("x-api-key", &s.key)
                .header("anthropic-version", "2023-01-01")
                .header("anthropic-beta", "prompt-caching-2024-07-31")
                .body(MESSAGES_REQUEST),
        )
        .await;

    assert_eq!(answer.status, 200);
    assert_eq!(answer.bytes, MESSAGES_REPLY.as_bytes());
    let seen = s.provider.last_seen();
    assert_eq!(seen.path, "/v1/messages");
    assert_eq!(seen.body, MESSAGES_REQUEST.as_bytes());
    assert_eq!(seen.headers["x-api-key"], ANTHROPIC_KEY);
    assert_eq!(seen.headers["anthropic-version"], "2023-01-01");
    assert_eq!(seen.headers["anthropic-beta"], "prompt-caching-2024-07-31");
    assert!(seen.headers.get("authorization").is_none());
    assert_no_header_carries(&seen, &s.key);

    let call = &s.db.calls(&s.key).await[0];
    assert_eq!(
        (call.input_tokens, call.output_tokens),
        (Some(410), Some(33))
    );
}

#[tokio::test]
async fn anthropic_version_defaults_when_the_client_sends_none() {
    let s = setup(30).await;
    s.provider.then(Script::Reply(200, MESSAGES_REPLY));
    assert_eq!(s.gateway.messages(&s.key, MESSAGES_MODEL).await.status, 200);
    assert_eq!(
        s.provider.last_seen().headers["anthropic-version"],
        "2023-06-01"
    );
}

#[tokio::test]
async fn upstream_model_renames_the_model_and_nothing_else() {
    let s = setup(30).await;
    s.provider.then(Script::Reply(200, CHAT_REPLY));
    let sent = CHAT_REQUEST.replace("\"gpt-4o-mini\"", "\"house-chat\"");
    assert_eq!(
        s.gateway
            .post_bearer(CHAT, &s.key, sent.clone())
            .await
            .status,
        200
    );
    let expected = CHAT_REQUEST.replace("\"gpt-4o-mini\"", "\"qwen2.5-7b-instruct\"");
    assert_eq!(s.provider.last_seen().body, expected.as_bytes());
}

/// Runs one call that the provider fails, and checks the refund.
async fn assert_refunded(s: &Setup, expected_status: Option<u16>, error_contains: &str) {
    let before = s.db.balance(&s.key).await;
    let answer = s.gateway.chat(&s.key, CHAT_MODEL).await;
    assert_eq!(answer.status, 502, "{answer:?}");
    assert_eq!(answer.detail(), "上游服务暂时不可用");
    assert_eq!(s.db.balance(&s.key).await, before, "credits must come back");
    let call = &s.db.calls(&s.key).await[0];
    assert_eq!(call.status, CallStatus::Refunded);
    assert_eq!(call.upstream_status, expected_status);
    let error = call.upstream_error.as_deref().unwrap();
    assert!(error.contains(error_contains), "{error}");
    assert!(
        !error.contains(OPENAI_KEY) && !error.contains(&s.key),
        "{error}"
    );
}

#[tokio::test]
async fn provider_error_statuses_are_refunded_and_answer_502() {
    let s = setup(30).await;
    for (status, body) in [
        (500, r#"{"error":{"message":"internal boom"}}"#),
        (429, r#"{"error":{"message":"rate limited"}}"#),
        (400, r#"{"error":{"message":"bad tool schema"}}"#),
    ] {
        s.provider.then(Script::Reply(status, body));
        let message = body.split('"').nth(5).unwrap();
        assert_refunded(&s, Some(status), message).await;
    }
    s.db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_provider_time_out_is_refunded_and_answers_502() {
    let s = setup(1).await;
    s.provider
        .then(Script::Delay(Duration::from_secs(3), 200, CHAT_REPLY));
    assert_refunded(&s, None, "timed out").await;
}

#[tokio::test]
async fn a_2xx_reply_that_is_not_json_is_refunded() {
    let s = setup(30).await;
    s.provider
        .then(Script::Reply(200, "<html>gateway error</html>"));
    assert_refunded(&s, Some(200), "not a JSON object").await;
}
