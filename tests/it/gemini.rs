//! Google's Gemini API through the example gateway over real HTTP: the rules of every call on
//! its paths, its keys (`x-goog-api-key`, `?key=`), a Gemini-kind provider reached byte for byte
//! and charged what its `usageMetadata` says, its failures refunded with a `502` in Google's
//! error shape, and every way a Gemini stream can end, billed or refunded exactly once on
//! `SQLite`, `PostgreSQL` and `MariaDB`.

use crate::common;
use crate::streaming::{corpus, cut_every, finished_call, leave_after, stream};

use common::fake_provider::{FakeProvider, Fault, StreamEnd};
use common::*;
use model_gateway::Catalogue;
use model_gateway::refund::CLIENT_LEFT_BEFORE_CONTENT;
use model_gateway::store::CallStatus;
use serde_json::{Value, json};

/// The demo's Gemini model priced per call.
const MOCK_MODEL: &str = "gemini-3.5-flash-lite";
const MOCK_PRICE: i64 = 1;

/// The model at the fake provider, priced per call, and its name there.
const MODEL: &str = "gemini-fake";
const PRICE: i64 = 3;
const UPSTREAM_MODEL: &str = "gemini-2.5-flash";
/// A token-priced one: an input token 1 credit, a cached one 0.1, an output token 2.
const TOKEN_MODEL: &str = "gemini-tokens";

fn call_path(model: &str) -> String {
    format!("/v1beta/models/{model}:generateContent")
}

fn stream_path(model: &str) -> String {
    format!("/v1beta/models/{model}:streamGenerateContent?alt=sse")
}

fn body() -> Value {
    json!({ "contents": [{ "role": "user", "parts": [{ "text": "Hello" }] }] })
}

/// A streaming catalogue with the Gemini models at `provider`, and `settings` on top.
fn provider_catalogue(provider: &FakeProvider, settings: &str) -> Catalogue {
    Catalogue::from_toml(&format!(
        "streaming = true\n{settings}\n\
         [[upstreams]]\nname = \"google\"\nkind = \"gemini\"\nbase_url = \"{base}\"\napi_key_env = \"K\"\n\
         [[models]]\nname = \"{MODEL}\"\nprotocol = \"gemini\"\nprice = {PRICE}\n\
         upstreams = [{{ name = \"google\", upstream_model = \"{UPSTREAM_MODEL}\" }}]\n\
         [[models]]\nname = \"{TOKEN_MODEL}\"\nprotocol = \"gemini\"\nupstream = \"google\"\nmax_output_tokens = 100\n\
         [models.tokens]\ninput = 1000000\noutput = 2000000\ncache_read = 100000\n",
        base = provider.base
    ))
    .unwrap()
}

/// Google's reply: `text`, finished, with 50 prompt tokens (20 of them cached), 10 candidate
/// and 5 thinking tokens, written as Google writes it (camelCase, the usage last).
const REPLY: &str = r#"{"candidates": [{"content": {"parts": [{"text": "Hi there"}],"role": "model"},"finishReason": "STOP","index": 0}],"usageMetadata": {"promptTokenCount": 50,"cachedContentTokenCount": 20,"candidatesTokenCount": 10,"thoughtsTokenCount": 5,"totalTokenCount": 65},"modelVersion": "gemini-2.5-flash","responseId": "abc"}"#;
/// What [`REPLY`]'s usage costs on the token-priced model: 30 + 2 + 30.
const REPLY_CREDITS: i64 = 62;

const CHUNK_TEXT: &str = "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"Hi\"}],\"role\": \"model\"},\"index\": 0}],\"usageMetadata\": {\"promptTokenCount\": 50,\"cachedContentTokenCount\": 20}}\r\n\r\n";
const CHUNK_EMPTY: &str = "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"\"}],\"role\": \"model\"},\"index\": 0}],\"usageMetadata\": {\"promptTokenCount\": 50}}\r\n\r\n";
const CHUNK_LAST: &str = "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \" there\"}],\"role\": \"model\"},\"finishReason\": \"STOP\",\"index\": 0}],\"usageMetadata\": {\"promptTokenCount\": 50,\"cachedContentTokenCount\": 20,\"candidatesTokenCount\": 10,\"thoughtsTokenCount\": 5,\"totalTokenCount\": 65}}\r\n\r\n";
const CHUNK_ERROR: &str = "data: {\"error\": {\"code\": 503,\"message\": \"The model is overloaded.\",\"status\": \"UNAVAILABLE\"}}\r\n\r\n";

#[tokio::test]
async fn the_rules_of_every_call_hold_on_the_gemini_api() {
    assert_the_rules_of_every_call(&call_path(MOCK_MODEL), &body(), MOCK_PRICE).await;
}

#[tokio::test]
async fn a_gemini_client_presents_its_key_as_googles_clients_do() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let post = |path: String| {
        gateway
            .client
            .post(format!("{}{path}", gateway.base))
            .header("content-type", "application/json")
            .body(body().to_string())
    };
    let by_header = gateway
        .send(post(call_path(MOCK_MODEL)).header("x-goog-api-key", &key))
        .await;
    assert_eq!(by_header.status, 200, "{by_header:?}");
    let reply: Value = serde_json::from_slice(&by_header.bytes).unwrap();
    assert_eq!(reply["candidates"][0]["finishReason"], "STOP");
    let by_query = gateway
        .send(post(format!("{}?key={key}", call_path(MOCK_MODEL))))
        .await;
    assert_eq!(by_query.status, 200);
    // Google's newer SDKs call the API's `v1`.
    let on_v1 = gateway
        .send(post(format!(
            "/v1/models/{MOCK_MODEL}:generateContent?key={key}"
        )))
        .await;
    assert_eq!(on_v1.status, 200, "{on_v1:?}");
    // A key in the query is the Gemini API's only: the other endpoints do not read it.
    let chat = gateway
        .send(
            gateway
                .client
                .post(format!("{}/v1/chat/completions?key={key}", gateway.base))
                .json(&json!({ "model": CHAT_MODEL, "messages": [{ "role": "user", "content": "Hi" }] })),
        )
        .await;
    assert_eq!((chat.status, chat.detail()), (401, "无效的 API Key"));
    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), 3);
    assert!(calls.iter().all(|call| call.protocol.as_str() == "gemini"));
    assert_eq!(db.balance(&key).await, balance(10 - 3 * MOCK_PRICE, 0));
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_model_is_on_the_gemini_api_only_when_it_serves_it() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let chat_model = gateway
        .post_bearer(&call_path(CHAT_MODEL), &key, body().to_string())
        .await;
    assert_eq!(
        (chat_model.status, chat_model.detail()),
        (404, "模型不存在")
    );
    let on_chat = gateway.chat(&key, MOCK_MODEL).await;
    assert_eq!((on_chat.status, on_chat.detail()), (404, "模型不存在"));
    let no_contents = gateway
        .post_bearer(&call_path(MOCK_MODEL), &key, r#"{"contents":"Hi"}"#)
        .await;
    assert_eq!(no_contents.status, 400);
    assert!(no_contents.detail().contains("contents"), "{no_contents:?}");
    // Streaming is off in the demo catalogue.
    let streamed = gateway
        .post_bearer(&stream_path(MOCK_MODEL), &key, body().to_string())
        .await;
    assert_eq!(streamed.status, 400);
    let get = gateway
        .send(
            gateway
                .client
                .get(format!("{}{}", gateway.base, call_path(MOCK_MODEL)))
                .bearer_auth(&key),
        )
        .await;
    assert_eq!(get.status, 405);
    assert!(db.calls(&key).await.is_empty());
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

#[tokio::test]
async fn a_gemini_provider_gets_the_request_and_the_client_its_reply_byte_for_byte() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, provider_catalogue(&provider, "")).await;
    let key = db.funded_key(0, 10_000).await;
    // Spaced and ordered as the client wrote it: passed as it is.
    let sent = r#"{ "contents": [{"role":"user","parts":[{"text":"Hello"}]}], "generationConfig": {"thinkingConfig": {"thinkingBudget": 128}} }"#;
    provider.then(Fault::json(200, REPLY));
    let answer = gateway
        .send(
            gateway
                .client
                .post(format!("{}{}", gateway.base, call_path(MODEL)))
                .header("x-goog-api-key", &key)
                .header("content-type", "application/json")
                .body(sent),
        )
        .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.bytes, REPLY.as_bytes());
    let seen = provider.last();
    assert_eq!(
        seen.target,
        format!("/v1beta/models/{UPSTREAM_MODEL}:generateContent")
    );
    assert_eq!(seen.body, sent.as_bytes());
    assert_eq!(seen.header("x-goog-api-key"), Some("sk-provider"));
    assert_eq!(seen.header("authorization"), None);
    let entry = db.calls(&key).await.remove(0);
    assert_eq!(entry.price.get(), PRICE);
    assert_eq!(entry.channel.as_deref(), Some("google"));

    // Priced by tokens: each kind once, as `usageMetadata` counts them.
    provider.then(Fault::json(200, REPLY));
    let priced = gateway
        .post_bearer(&call_path(TOKEN_MODEL), &key, body().to_string())
        .await;
    assert_eq!(priced.status, 200);
    let entry = db.calls(&key).await.remove(0);
    assert_eq!(
        (
            entry.input_tokens,
            entry.cache_read_tokens,
            entry.output_tokens
        ),
        (Some(30), Some(20), Some(15))
    );
    assert_eq!(entry.price.get(), REPLY_CREDITS);
    assert_eq!(
        db.balance(&key).await,
        balance(0, 10_000 - PRICE - REPLY_CREDITS)
    );
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_gemini_providers_failure_is_refunded_with_a_502_in_googles_shape() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let catalogue = provider_catalogue(&provider, "error_body = \"compatible\"");
    let gateway = http_gateway(&db, catalogue).await;
    let key = db.funded_key(10, 0).await;
    let internal = r#"{"error": {"code": 500, "message": "Internal error encountered.", "status": "INTERNAL"}}"#;
    provider.always(Fault::json(500, internal));
    let failed = gateway
        .post_bearer(&call_path(MODEL), &key, body().to_string())
        .await;
    assert_eq!(failed.status, 502);
    let answer: Value = serde_json::from_slice(&failed.bytes).unwrap();
    assert_eq!(
        answer,
        json!({
            "detail": "上游服务暂时不可用",
            "error": { "code": 502, "message": "上游服务暂时不可用", "status": "UNAVAILABLE" },
        })
    );
    let entry = db.calls(&key).await.remove(0);
    assert_eq!(entry.status, CallStatus::Refunded);
    assert!(
        entry.upstream_error.as_deref().unwrap().contains("500"),
        "{entry:?}"
    );
    assert_eq!(db.balance(&key).await, balance(10, 0));
    db.assert_audit_holds().await;
}

/// Every way a Gemini stream ends: finished (charged what its last `usageMetadata` says), cut,
/// an error object, the client leaving before and after content; each written once.
async fn assert_every_gemini_stream_ending_writes_one_outcome(db: TestDb) {
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, provider_catalogue(&provider, "")).await;
    let key = db.funded_key(0, 10_000).await;
    let mut spent = 0;

    provider.then(Fault::sse([CHUNK_EMPTY, CHUNK_TEXT, CHUNK_LAST]));
    let finished = stream(&gateway, &stream_path(TOKEN_MODEL), &key, body()).await;
    assert_eq!(finished.status, 200);
    assert_eq!(
        finished.text(),
        format!("{CHUNK_EMPTY}{CHUNK_TEXT}{CHUNK_LAST}")
    );
    let seen = provider.last();
    assert_eq!(
        seen.target,
        format!("/v1beta/models/{TOKEN_MODEL}:streamGenerateContent?alt=sse")
    );
    let entry = finished_call(&db, &key).await;
    assert_eq!(
        (entry.status, entry.price.get()),
        (CallStatus::Ok, REPLY_CREDITS)
    );
    spent += REPLY_CREDITS;

    provider.then(Fault::sse([CHUNK_TEXT]).ending(StreamEnd::Cut));
    let cut = stream(&gateway, &stream_path(MODEL), &key, body()).await;
    let last = cut.data().pop().unwrap();
    assert_eq!(last["error"]["status"], "UNAVAILABLE", "{}", cut.text());
    assert_eq!(last["error"]["message"], "上游服务暂时不可用");
    assert_eq!(finished_call(&db, &key).await.status, CallStatus::Refunded);

    provider.then(Fault::sse([CHUNK_TEXT, CHUNK_ERROR]).ending(StreamEnd::Hang));
    let errored = stream(&gateway, &stream_path(MODEL), &key, body()).await;
    assert!(!errored.text().contains("overloaded"), "{}", errored.text());
    let entry = finished_call(&db, &key).await;
    assert_eq!(entry.status, CallStatus::Refunded);
    assert!(
        entry
            .upstream_error
            .as_deref()
            .unwrap()
            .contains("UNAVAILABLE: The model is overloaded."),
        "{entry:?}"
    );

    for (events, billed) in [(vec![CHUNK_EMPTY], false), (vec![CHUNK_TEXT], true)] {
        leave_after(
            &gateway,
            &provider,
            &stream_path(MODEL),
            &key,
            body(),
            &events,
        )
        .await;
        let entry = finished_call(&db, &key).await;
        if billed {
            assert_eq!(entry.status, CallStatus::Ok);
            spent += PRICE;
        } else {
            assert_eq!(entry.status, CallStatus::Refunded);
            assert_eq!(
                entry.upstream_error.as_deref(),
                Some(CLIENT_LEFT_BEFORE_CONTENT)
            );
        }
    }
    assert_eq!(db.calls(&key).await.len(), 5);
    assert_eq!(db.balance(&key).await, balance(0, 10_000 - spent));
    db.assert_audit_holds().await;
    db.drop_schema().await;
}

backends!(
    async fn every_gemini_stream_ending_writes_one_outcome(db) {
        assert_every_gemini_stream_ending_writes_one_outcome(db).await;
    }
);

/// Without `alt=sse`, Google answers a stream as one JSON array of its responses: so does the
/// gateway, billing it as the events it reads (a mid-way failure the array's last element).
#[tokio::test]
async fn a_stream_without_alt_sse_is_one_json_array() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, provider_catalogue(&provider, "")).await;
    let key = db.funded_key(0, 10_000).await;
    let path = format!("/v1beta/models/{TOKEN_MODEL}:streamGenerateContent");

    provider.then(Fault::sse([CHUNK_EMPTY, CHUNK_TEXT, CHUNK_LAST]));
    let answered = stream(&gateway, &path, &key, body()).await;
    assert_eq!(answered.status, 200);
    assert_eq!(answered.content_type(), "application/json");
    let array: Value = serde_json::from_str(&answered.text()).unwrap();
    let texts: Vec<&str> = array
        .as_array()
        .unwrap()
        .iter()
        .map(|response| {
            response["candidates"][0]["content"]["parts"][0]["text"]
                .as_str()
                .unwrap()
        })
        .collect();
    assert_eq!(texts, ["", "Hi", " there"]);
    assert_eq!(array[2]["usageMetadata"]["thoughtsTokenCount"], 5);
    // The provider is asked for events all the same.
    assert!(
        provider
            .last()
            .target
            .ends_with(":streamGenerateContent?alt=sse")
    );
    let entry = finished_call(&db, &key).await;
    assert_eq!(
        (entry.status, entry.price.get()),
        (CallStatus::Ok, REPLY_CREDITS)
    );

    provider.then(Fault::sse([CHUNK_TEXT]).ending(StreamEnd::Cut));
    let cut = stream(&gateway, &path, &key, body()).await;
    let array: Value = serde_json::from_str(&cut.text()).unwrap();
    assert_eq!(array.as_array().unwrap().len(), 2, "{array}");
    assert_eq!(array[1]["error"]["status"], "UNAVAILABLE");
    assert_eq!(finished_call(&db, &key).await.status, CallStatus::Refunded);
    assert_eq!(db.balance(&key).await, balance(0, 10_000 - REPLY_CREDITS));
    db.assert_audit_holds().await;
}

// --- Gemini clients on the other protocols' models, translated -----------------------------

/// A token-priced model whose provider speaks chat completions, and one whose provider speaks
/// Anthropic's messages, both answering on the Gemini API too.
const CHAT_METERED: &str = "chat-for-gemini";
const MESSAGES_METERED: &str = "claude-for-gemini";

fn translating_catalogue(provider: &FakeProvider) -> Catalogue {
    Catalogue::from_toml(&format!(
        r#"
        streaming = true

        [[upstreams]]
        name = "chat-only"
        kind = "openai"
        base_url = "{base}/v1"
        api_key_env = "K"

        [[upstreams]]
        name = "messages-only"
        kind = "anthropic"
        base_url = "{base}"
        api_key_env = "K"

        [[models]]
        name = "{CHAT_METERED}"
        protocol = "chat_completions"
        endpoints = ["chat_completions", "gemini"]
        upstream = "chat-only"
        max_output_tokens = 1000
        context_window = 100000
        [models.tokens]
        input = 100000
        output = 400000
        cache_read = 50000

        [[models]]
        name = "{MESSAGES_METERED}"
        protocol = "messages"
        endpoints = ["messages", "gemini"]
        upstream = "messages-only"
        max_output_tokens = 1000
        context_window = 100000
        [models.tokens]
        input = 100000
        output = 400000
        cache_read = 50000
        cache_write = 125000
        "#,
        base = provider.base
    ))
    .unwrap()
}

fn chat_completion(usage: &Value) -> String {
    json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{ "index": 0, "message": { "role": "assistant", "content": "Hello there, friend" }, "finish_reason": "stop" }],
        "usage": usage,
    })
    .to_string()
}

fn chat_events(usage: &Value) -> Vec<String> {
    vec![
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n".into(),
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello there, friend\"}}]}\n\n".into(),
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n".into(),
        format!("data: {}\n\n", json!({ "choices": [], "usage": usage })),
        "data: [DONE]\n\n".into(),
    ]
}

/// What a call cost and what its entry recorded of each kind of token.
fn billed(entry: &model_gateway::store::CallRecord) -> [Option<i64>; 5] {
    [
        Some(entry.price.get()),
        entry.input_tokens,
        entry.output_tokens,
        entry.cache_read_tokens,
        entry.reasoning_tokens,
    ]
}

/// For each shape a chat provider's usage takes, complete and streamed, the Gemini call is
/// charged exactly what the chat call is, and its entry records the same tokens.
#[tokio::test]
async fn the_same_chat_usage_costs_the_same_credits_by_the_gemini_api() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, translating_catalogue(&provider)).await;
    let key = db.funded_key(100_000, 0).await;
    let shapes = [
        json!({ "prompt_tokens": 3000, "completion_tokens": 40,
                "prompt_tokens_details": { "cached_tokens": 2500 },
                "completion_tokens_details": { "reasoning_tokens": 25 } }),
        json!({ "prompt_tokens": 900, "completion_tokens": 12 }),
    ];
    let question = "Hello there. ".repeat(100);
    for usage in &shapes {
        for streamed in [false, true] {
            let mut entries = Vec::new();
            let chat = json!({ "model": CHAT_METERED, "max_tokens": 100, "stream": streamed,
                               "messages": [{ "role": "user", "content": question }] });
            let gemini = json!({ "contents": [{ "role": "user", "parts": [{ "text": question }] }],
                                 "generationConfig": { "maxOutputTokens": 100 } });
            let gemini_path = if streamed {
                stream_path(CHAT_METERED)
            } else {
                call_path(CHAT_METERED)
            };
            for (path, body) in [
                ("/v1/chat/completions".to_owned(), chat),
                (gemini_path, gemini),
            ] {
                provider.then(if streamed {
                    Fault::sse(chat_events(usage))
                } else {
                    Fault::json(200, &chat_completion(usage))
                });
                let answer = gateway.post_bearer(&path, &key, body.to_string()).await;
                assert_eq!(answer.status, 200, "{usage} {path}: {answer:?}");
                let entry = finished_call(&db, &key).await;
                assert_eq!(entry.status, CallStatus::Ok, "{usage} {path}");
                entries.push(billed(&entry));
            }
            assert_eq!(entries[0], entries[1], "{usage}, streamed {streamed}");
            assert!(entries[0][0].unwrap() > 0);
        }
    }
    // The Gemini client's reply carries the same usage, in Google's names.
    provider.then(Fault::json(200, &chat_completion(&shapes[0])));
    let answer = gateway
        .post_bearer(&call_path(CHAT_METERED), &key, body().to_string())
        .await;
    let reply: Value = serde_json::from_slice(&answer.bytes).unwrap();
    assert_eq!(
        reply["usageMetadata"],
        json!({ "promptTokenCount": 3000, "cachedContentTokenCount": 2500,
                "candidatesTokenCount": 15, "thoughtsTokenCount": 25, "totalTokenCount": 3040 })
    );
    db.assert_audit_holds().await;
}

const MESSAGE: &str = r#"{"id":"msg_1","type":"message","role":"assistant","model":"claude","content":[{"type":"tool_use","id":"toolu_1","name":"weather","input":{"city":"Paris"}}],"stop_reason":"tool_use","stop_sequence":null,"usage":{"input_tokens":50,"cache_read_input_tokens":400,"output_tokens":20}}"#;

const MESSAGE_EVENTS: [&str; 6] = [
    "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude\",\"usage\":{\"input_tokens\":50,\"cache_read_input_tokens\":400,\"output_tokens\":1}}}\n\n",
    "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
    "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Sunny\"}}\n\n",
    "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
    "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":20}}\n\n",
    "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
];

/// A Gemini client on a model whose provider speaks Anthropic's messages: translated through
/// chat completions both ways, complete and streamed, billed as the messages call is; a field
/// with no equivalent refused before any charge.
#[tokio::test]
async fn a_gemini_client_reaches_an_anthropic_model_through_the_translations() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, translating_catalogue(&provider)).await;
    let key = db.funded_key(100_000, 0).await;
    let request = json!({
        "systemInstruction": { "parts": [{ "text": "Use tools." }] },
        "contents": [{ "role": "user", "parts": [{ "text": "Paris?" }] }],
        "tools": [{ "functionDeclarations": [{ "name": "weather",
            "parameters": { "type": "OBJECT", "properties": { "city": { "type": "STRING" } } } }] }],
        "generationConfig": { "maxOutputTokens": 64 },
    });
    provider.then(Fault::json(200, MESSAGE));
    let answer = gateway
        .post_bearer(&call_path(MESSAGES_METERED), &key, request.to_string())
        .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let sent: Value = serde_json::from_slice(&provider.last().body).unwrap();
    assert_eq!(provider.last().target, "/v1/messages");
    assert_eq!(
        sent["system"],
        json!([{ "type": "text", "text": "Use tools." }])
    );
    assert_eq!(sent["max_tokens"], 64);
    assert_eq!(
        sent["tools"][0]["input_schema"],
        json!({ "type": "object", "properties": { "city": { "type": "string" } } })
    );
    let reply: Value = serde_json::from_slice(&answer.bytes).unwrap();
    assert_eq!(
        reply["candidates"][0]["content"]["parts"][0]["functionCall"],
        json!({ "id": "toolu_1", "name": "weather", "args": { "city": "Paris" } })
    );
    assert_eq!(reply["usageMetadata"]["cachedContentTokenCount"], 400);
    let gemini = billed(&finished_call(&db, &key).await);

    // The same provider usage through the messages endpoint costs the same.
    provider.then(Fault::json(200, MESSAGE));
    let native = json!({ "model": MESSAGES_METERED, "max_tokens": 64,
                         "messages": [{ "role": "user", "content": "Paris?" }] });
    let answer = gateway
        .post_bearer("/v1/messages", &key, native.to_string())
        .await;
    assert_eq!(answer.status, 200);
    assert_eq!(billed(&finished_call(&db, &key).await), gemini);

    provider.then(Fault::sse(MESSAGE_EVENTS));
    let streamed = stream(
        &gateway,
        &stream_path(MESSAGES_METERED),
        &key,
        request.clone(),
    )
    .await;
    let responses = streamed.data();
    assert_eq!(
        responses[0]["candidates"][0]["content"]["parts"][0]["text"],
        "Sunny",
        "{}",
        streamed.text()
    );
    let last = responses.last().unwrap();
    assert_eq!(last["candidates"][0]["finishReason"], "STOP");
    assert_eq!(last["usageMetadata"]["promptTokenCount"], 450);
    let entry = finished_call(&db, &key).await;
    assert_eq!(entry.status, CallStatus::Ok);
    assert_eq!(billed(&entry), gemini);

    // No equivalent: refused, naming the field, before anything is charged.
    let spent = db.balance(&key).await;
    let calls = db.calls(&key).await.len();
    let refused = gateway
        .post_bearer(
            &call_path(MESSAGES_METERED),
            &key,
            json!({ "contents": [], "cachedContent": "cachedContents/1" }).to_string(),
        )
        .await;
    assert_eq!(refused.status, 400);
    assert!(refused.detail().contains("cachedContent"), "{refused:?}");
    assert_eq!(db.balance(&key).await, spent);
    assert_eq!(db.calls(&key).await.len(), calls);
    db.assert_audit_holds().await;
}

// --- Every client on a Gemini model: the same usage, the same credits ------------------------

/// A token-priced Gemini model every client may call.
const EVERY_CLIENT: &str = "gemini-for-every-client";

fn every_client_catalogue(provider: &FakeProvider) -> Catalogue {
    Catalogue::from_toml(&format!(
        "streaming = true\n\
         [[upstreams]]\nname = \"google\"\nkind = \"gemini\"\nbase_url = \"{base}\"\napi_key_env = \"K\"\n\
         [[models]]\nname = \"{EVERY_CLIENT}\"\nprotocol = \"gemini\"\nupstream = \"google\"\n\
         endpoints = [\"gemini\", \"chat_completions\", \"responses\", \"messages\"]\n\
         max_output_tokens = 1000\ncontext_window = 100000\n\
         [models.tokens]\ninput = 100000\noutput = 400000\ncache_read = 50000\n",
        base = provider.base
    ))
    .unwrap()
}

/// A call on `EVERY_CLIENT` by each client, complete or streamed: its path and body. The
/// question is long enough for the usages below to fit within each call's reservation (which
/// rests on the request's size, so that it differs by client).
fn every_client_calls(streamed: bool) -> [(String, Value); 4] {
    let question = "Hello there. ".repeat(1_000);
    let gemini_path = if streamed {
        stream_path(EVERY_CLIENT)
    } else {
        call_path(EVERY_CLIENT)
    };
    [
        (
            gemini_path,
            json!({ "contents": [{ "role": "user", "parts": [{ "text": question }] }],
                    "generationConfig": { "maxOutputTokens": 100 } }),
        ),
        (
            "/v1/chat/completions".into(),
            json!({ "model": EVERY_CLIENT, "max_tokens": 100, "stream": streamed,
                    "messages": [{ "role": "user", "content": question }] }),
        ),
        (
            "/v1/messages".into(),
            json!({ "model": EVERY_CLIENT, "max_tokens": 100, "stream": streamed,
                    "messages": [{ "role": "user", "content": question }] }),
        ),
        (
            "/v1/responses".into(),
            json!({ "model": EVERY_CLIENT, "max_output_tokens": 100, "stream": streamed,
                    "input": question }),
        ),
    ]
}

fn gemini_reply(usage: &Value) -> String {
    json!({
        "candidates": [{ "content": { "role": "model", "parts": [{ "text": "Hello there, friend" }] },
                         "finishReason": "STOP", "index": 0 }],
        "usageMetadata": usage,
    })
    .to_string()
}

fn gemini_events(usage: &Value) -> Vec<String> {
    let chunk = |text: &str, last: bool| {
        let mut response = json!({
            "candidates": [{ "content": { "role": "model", "parts": [{ "text": text }] }, "index": 0 }],
        });
        if last {
            response["candidates"][0]["finishReason"] = json!("STOP");
            response["usageMetadata"] = usage.clone();
        }
        format!("data: {response}\r\n\r\n")
    };
    vec![chunk("Hello there, ", false), chunk("friend", true)]
}

/// For each shape Google's usage takes (cached input and thoughts; tool-use prompt tokens;
/// plain; a count that is no count), complete and streamed, a call on a Gemini model records
/// the same tokens and is charged the same credits whichever client made it: Google's own,
/// chat completions, messages or Responses (translated both ways).
#[tokio::test]
async fn the_same_gemini_usage_costs_the_same_credits_on_every_endpoint() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, every_client_catalogue(&provider)).await;
    let key = db.funded_key(1_000_000, 0).await;
    let shapes = [
        (
            "cached input and thoughts",
            json!({ "promptTokenCount": 3000, "cachedContentTokenCount": 2500,
                    "candidatesTokenCount": 15, "thoughtsTokenCount": 25, "totalTokenCount": 3040 }),
        ),
        (
            "tool-use prompt tokens",
            json!({ "promptTokenCount": 900, "toolUsePromptTokenCount": 40,
                    "candidatesTokenCount": 12, "totalTokenCount": 952 }),
        ),
        (
            "plain",
            json!({ "promptTokenCount": 7, "candidatesTokenCount": 3 }),
        ),
        (
            "a count that is no count",
            json!({ "promptTokenCount": "many", "candidatesTokenCount": 3 }),
        ),
    ];
    for (shape, usage) in &shapes {
        for streamed in [false, true] {
            let mut entries = Vec::new();
            for (path, body) in every_client_calls(streamed) {
                provider.then(if streamed {
                    Fault::sse(gemini_events(usage))
                } else {
                    Fault::json(200, &gemini_reply(usage))
                });
                let answer = gateway.post_bearer(&path, &key, body.to_string()).await;
                assert_eq!(answer.status, 200, "{shape} {path}: {answer:?}");
                assert!(
                    provider
                        .last()
                        .target
                        .starts_with(&format!("/v1beta/models/{EVERY_CLIENT}:")),
                    "{path}: {}",
                    provider.last().target
                );
                let entry = finished_call(&db, &key).await;
                assert_eq!(entry.status, CallStatus::Ok, "{shape} {path}");
                assert_eq!(
                    entry.usage_rejected,
                    *shape == "a count that is no count",
                    "{shape} {path}"
                );
                entries.push((path, billed(&entry)));
            }
            let (_, native) = &entries[0];
            for (path, billed) in &entries[1..] {
                if *shape == "a count that is no count" {
                    // Charged the call's ceiling, which rests on the request's size: the
                    // tokens recorded alike.
                    assert_eq!(
                        billed[1..],
                        native[1..],
                        "{shape}, streamed {streamed}, {path}"
                    );
                } else {
                    assert_eq!(billed, native, "{shape}, streamed {streamed}, {path}");
                }
            }
        }
    }
    db.assert_audit_holds().await;
}

/// Google's recorded streams (`tests/corpus/streams/gemini`: thoughts with cached input, a
/// function call with tool-use prompt tokens, multi-byte text) reach the client byte for byte
/// however the provider cuts them, and as the JSON array of their responses without `alt=sse`;
/// each call records the tokens its last `usageMetadata` gives.
#[tokio::test]
async fn recorded_gemini_streams_reach_the_client_byte_for_byte_or_as_one_array() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, provider_catalogue(&provider, "")).await;
    let key = db.funded_key(0, 1_000).await;
    let expected_tokens = |name: &str| match name {
        "function_call.sse" => (Some(8046), None, Some(31)),
        "thoughts_cached.sse" => (Some(186), Some(1024), Some(17)),
        "unicode.sse" => (Some(9), None, Some(6)),
        other => panic!("a case without its tokens: {other}"),
    };
    let mut cases = 0;
    for (name, recorded) in corpus("gemini") {
        for size in [recorded.len(), 7, 1] {
            provider.then(Fault::sse(cut_every(&recorded, size)));
            let received = stream(&gateway, &stream_path(MODEL), &key, body()).await;
            assert_eq!(received.status, 200, "{name}");
            assert_eq!(received.bytes(), recorded, "{name} cut every {size} bytes");
            let entry = finished_call(&db, &key).await;
            assert_eq!(entry.status, CallStatus::Ok, "{name}");
            assert_eq!(
                (
                    entry.input_tokens,
                    entry.cache_read_tokens,
                    entry.output_tokens
                ),
                expected_tokens(&name),
                "{name}"
            );
        }
        provider.then(Fault::sse(cut_every(&recorded, 5)));
        let path = format!("/v1beta/models/{MODEL}:streamGenerateContent");
        let array = stream(&gateway, &path, &key, body()).await;
        let array: Vec<Value> = serde_json::from_str(&array.text()).unwrap();
        let events: Vec<Value> = String::from_utf8(recorded.clone())
            .unwrap()
            .split_terminator("\r\n\r\n")
            .map(|event| serde_json::from_str(event.strip_prefix("data: ").unwrap()).unwrap())
            .collect();
        assert_eq!(array, events, "{name}");
        cases += 1;
    }
    assert_eq!(cases, 3);
    assert_eq!(db.balance(&key).await, balance(0, 1_000 - 12 * PRICE));
    db.assert_audit_holds().await;
}

/// A request naming Google's stored `cachedContent` brings input its size does not bound: on a
/// token-priced model it reserves the model's whole context window and is charged its report in
/// full; a model without `context_window` refuses it, naming the field, before any charge.
#[tokio::test]
async fn cached_content_reserves_the_context_window_or_is_refused() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let catalogue = Catalogue::from_toml(&format!(
        "[[upstreams]]\nname = \"google\"\nkind = \"gemini\"\nbase_url = \"{base}\"\napi_key_env = \"K\"\n\
         [[models]]\nname = \"{TOKEN_MODEL}\"\nprotocol = \"gemini\"\nupstream = \"google\"\nmax_output_tokens = 100\n\
         [models.tokens]\ninput = 1000000\noutput = 2000000\ncache_read = 100000\n\
         [[models]]\nname = \"windowed\"\nprotocol = \"gemini\"\nupstream = \"google\"\nmax_output_tokens = 100\n\
         context_window = 200000\n\
         [models.tokens]\ninput = 1000000\noutput = 2000000\ncache_read = 100000\n",
        base = provider.base
    ))
    .unwrap();
    let gateway = http_gateway(&db, catalogue).await;
    let key = db.funded_key(0, 300_000).await;
    let request = json!({
        "cachedContent": "cachedContents/abc",
        "contents": [{ "role": "user", "parts": [{ "text": "And the second chapter?" }] }],
    })
    .to_string();

    let refused = gateway
        .post_bearer(&call_path(TOKEN_MODEL), &key, request.clone())
        .await;
    assert_eq!(refused.status, 400, "{refused:?}");
    assert!(refused.detail().contains("cachedContent"), "{refused:?}");
    assert_eq!(provider.requests(), 0);

    // 100,000 cached tokens at 0.1, 50 more at 1, 10 out at 2: 10,070 credits, far past what
    // the request's bytes would have reserved.
    let usage = r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"It begins..."}]},"finishReason":"STOP","index":0}],"usageMetadata":{"promptTokenCount":100050,"cachedContentTokenCount":100000,"candidatesTokenCount":10,"totalTokenCount":100060}}"#;
    provider.then(Fault::json(200, usage));
    let answered = gateway
        .post_bearer(&call_path("windowed"), &key, request)
        .await;
    assert_eq!(answered.status, 200, "{answered:?}");
    let entry = db.calls(&key).await.remove(0);
    assert!(!entry.usage_rejected);
    assert_eq!(entry.price.get(), 10_070);
    assert_eq!(db.balance(&key).await, balance(0, 300_000 - 10_070));
    db.assert_audit_holds().await;
}

/// The model list in Google's shape: the demo's models on the Gemini API, by name, a page at a
/// time; one model by name; on `/v1/models` too for a
/// Google client, which OpenAI's clients still get in their own shape.
#[tokio::test]
async fn the_model_list_is_googles_a_page_at_a_time() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let get = |path: &str, google: bool| {
        let request = gateway.client.get(format!("{}{path}", gateway.base));
        if google {
            request.header("x-goog-api-key", &key)
        } else {
            request.bearer_auth(&key)
        }
    };
    let first = gateway.send(get("/v1beta/models?pageSize=3", true)).await;
    assert_eq!(first.status, 200, "{first:?}");
    let names = |answer: &Value| -> Vec<String> {
        answer["models"]
            .as_array()
            .unwrap()
            .iter()
            .map(|model| model["name"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        names(&first.body),
        [
            "models/claude-sonnet-5-5",
            "models/deepseek-chat",
            "models/gemini-2.5-flash"
        ]
    );
    let token = first.body["nextPageToken"].as_str().unwrap().to_owned();
    let rest = gateway
        .send(get(
            &format!("/v1beta/models?pageSize=3&pageToken={token}"),
            true,
        ))
        .await;
    assert_eq!(
        names(&rest.body),
        [
            "models/gemini-3.1-pro-preview",
            "models/gemini-3.5-flash-lite"
        ]
    );
    assert!(rest.body.get("nextPageToken").is_none());
    let on_v1 = gateway.send(get("/v1/models", true)).await;
    assert_eq!(names(&on_v1.body).len(), 5);
    let openai = gateway.send(get("/v1/models", false)).await;
    assert_eq!(openai.body["object"], "list");

    let one = gateway
        .send(get("/v1beta/models/gemini-2.5-flash", true))
        .await;
    assert_eq!(one.status, 200, "{one:?}");
    assert_eq!(one.body["outputTokenLimit"], 8192);
    assert!(one.body.get("inputTokenLimit").is_none());
    let chat_only = gateway.send(get("/v1beta/models/gpt-4o-mini", true)).await;
    assert_eq!((chat_only.status, chat_only.detail()), (404, "模型不存在"));
    assert!(db.calls(&key).await.is_empty());
}

/// Google's streams have no end event of their own: with two candidates that finish in
/// different chunks, the stream goes on to the second's finish and its close is its normal
/// end: passed whole and billed, not refunded as a cut. A stream closed before its candidates
/// finished is a cut.
#[tokio::test]
async fn a_stream_whose_candidates_finish_apart_ends_when_google_closes_it() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, provider_catalogue(&provider, "")).await;
    let key = db.funded_key(10, 0).await;
    let candidate = |index: u64, text: &str, finish: bool| {
        let mut candidate = json!({
            "content": { "role": "model", "parts": [{ "text": text }] }, "index": index,
        });
        if finish {
            candidate["finishReason"] = json!("STOP");
        }
        candidate
    };
    let chunk = |candidates: Vec<Value>, usage: bool| {
        let mut response = json!({ "candidates": candidates });
        if usage {
            response["usageMetadata"] =
                json!({ "promptTokenCount": 5, "candidatesTokenCount": 8, "totalTokenCount": 13 });
        }
        format!("data: {response}\r\n\r\n")
    };
    // The first candidate's last chunk names it alone: every candidate in it has finished,
    // but the second goes on.
    let events = [
        chunk(
            vec![candidate(0, "One", false), candidate(1, "Two", false)],
            false,
        ),
        chunk(vec![candidate(0, " done", true)], false),
        chunk(vec![candidate(1, " more", false)], false),
        chunk(vec![candidate(1, " done", true)], true),
    ];
    let body = json!({ "contents": [{ "parts": [{ "text": "Hi" }] }],
                       "generationConfig": { "candidateCount": 2 } });
    provider.then(Fault::sse(&events));
    let answered = stream(&gateway, &stream_path(MODEL), &key, body.clone()).await;
    assert_eq!(answered.text(), events.concat());
    let entry = finished_call(&db, &key).await;
    assert_eq!(entry.status, CallStatus::Ok, "{entry:?}");
    assert_eq!(entry.output_tokens, Some(8));

    provider.then(Fault::sse(&events[..1]));
    let cut = stream(&gateway, &stream_path(MODEL), &key, body).await;
    assert_eq!(cut.data().pop().unwrap()["error"]["status"], "UNAVAILABLE");
    assert_eq!(finished_call(&db, &key).await.status, CallStatus::Refunded);
    assert_eq!(db.balance(&key).await, balance(10 - PRICE, 0));
    db.assert_audit_holds().await;
}
