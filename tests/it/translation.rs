//! A messages call on a model whose provider speaks only chat completions, over real HTTP:
//! translated both ways (a complete reply and a stream), refused before any charge where it
//! has no equivalent, refunded on every way a stream fails, billed once when a client leaves
//! after content, and charged the same credits as the same model's chat call for the same
//! provider usage, whatever shape that usage has.

use crate::common;
use crate::streaming::{Streamed, finished_call, stream};

use std::time::Duration;

use common::fake_provider::{FakeProvider, Fault, StreamEnd};
use common::*;
use model_gateway::{Catalogue, Protocol, refund::CLIENT_LEFT_BEFORE_CONTENT, store::CallStatus};
use serde_json::{Value, json};

/// A chat-completions model answering on messages too.
const MODEL: &str = "gpt-on-messages";
const PRICE: i64 = 2;
/// The same provider behind a model priced by tokens.
const METERED: &str = "metered-on-messages";

fn catalogue(provider: &FakeProvider, settings: &str) -> Catalogue {
    Catalogue::from_toml(&format!(
        r#"
        streaming = true
        {settings}

        [[upstreams]]
        name = "chat-only"
        kind = "openai"
        base_url = "{}/v1"
        api_key_env = "K"

        [[models]]
        name = "{MODEL}"
        protocol = "chat_completions"
        endpoints = ["chat_completions", "messages"]
        price = {PRICE}
        upstream = "chat-only"
        upstream_model = "deepseek-chat"

        [[models]]
        name = "{METERED}"
        protocol = "chat_completions"
        endpoints = ["chat_completions", "messages", "responses"]
        upstream = "chat-only"
        max_output_tokens = 1000
        context_window = 100000
        [models.tokens]
        input = 100000
        output = 400000
        cache_read = 50000
        cache_write = 125000
        "#,
        provider.base
    ))
    .unwrap()
}

const CHAT_REPLY: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"deepseek-chat","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":21,"completion_tokens":9,"total_tokens":30}}"#;

const ROLE: &str =
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n";
const DELTA: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n";
const FINISH: &str =
    "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n";
const USAGE: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2,\"total_tokens\":9}}\n\n";
const DONE: &str = "data: [DONE]\n\n";

fn messages(model: &str, stream: bool) -> Value {
    json!({
        "model": model, "max_tokens": 64, "stream": stream,
        "system": "Use tools.",
        "messages": [{ "role": "user", "content": "Paris?" }],
        "tools": [{ "name": "get_weather", "input_schema": { "type": "object" } }],
    })
}

#[tokio::test]
async fn a_messages_call_on_a_chat_provider_is_translated_both_ways_and_billed_once() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, catalogue(&provider, "")).await;
    let key = db.funded_key(10, 0).await;

    provider.then(Fault::json(200, CHAT_REPLY));
    let answer = gateway
        .post_x_api_key(MESSAGES, &key, messages(MODEL, false).to_string())
        .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let seen = provider.last();
    assert_eq!(seen.target, "/v1/chat/completions");
    assert_eq!(seen.header("authorization"), Some("Bearer sk-provider"));
    let chat: Value = serde_json::from_slice(&seen.body).unwrap();
    assert_eq!(chat["model"], "deepseek-chat");
    assert_eq!(
        chat["messages"][0],
        json!({ "role": "system", "content": "Use tools." })
    );
    assert_eq!(chat["tools"][0]["function"]["name"], "get_weather");
    let message = &answer.body;
    assert_eq!(
        (message["type"].as_str(), message["model"].as_str()),
        (Some("message"), Some(MODEL))
    );
    assert!(message["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(
        message["content"][0],
        json!({ "type": "tool_use", "id": "call_1", "name": "get_weather", "input": { "city": "Paris" } })
    );
    assert_eq!(message["stop_reason"], "tool_use");
    assert_eq!(
        message["usage"],
        json!({ "input_tokens": 21, "output_tokens": 9 })
    );
    let [entry] = db.calls(&key).await.try_into().unwrap();
    assert_eq!(
        (entry.protocol, entry.status, entry.channel.as_deref()),
        (Protocol::Messages, CallStatus::Ok, Some("chat-only"))
    );
    assert_eq!(entry.upstream_protocol, Some(Protocol::ChatCompletions));
    assert_eq!(entry.dropped_tools, None);
    assert_eq!(
        (entry.input_tokens, entry.output_tokens),
        (Some(21), Some(9))
    );
    assert_eq!(db.balance(&key).await, balance(10 - PRICE, 0));
}

/// The `event:` names of a stream, in order.
fn names(received: &Streamed) -> Vec<String> {
    received
        .text()
        .split_terminator("\n\n")
        .filter_map(|event| event.strip_prefix("event: ")?.split('\n').next())
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn a_chat_stream_arrives_as_anthropics_events_and_is_billed_once() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, catalogue(&provider, "")).await;
    let key = db.funded_key(10, 0).await;
    provider.then(
        Fault::sse([ROLE, DELTA, ": keep-alive\n\n", DELTA, FINISH, USAGE, DONE])
            .spaced(Duration::from_millis(5)),
    );
    let received = stream(&gateway, MESSAGES, &key, messages(MODEL, true)).await;
    assert_eq!(received.status, 200);
    let chat: Value = serde_json::from_slice(&provider.last().body).unwrap();
    assert_eq!(chat["stream_options"], json!({ "include_usage": true }));
    assert_eq!(received.joined_text(), "HiHi");
    assert_eq!(
        names(&received),
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "ping",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let delta = &received.data()[7];
    assert_eq!(delta["usage"]["output_tokens"], 2);
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    let entry = finished_call(&db, &key).await;
    assert_eq!(
        (entry.status, entry.input_tokens, entry.output_tokens),
        (CallStatus::Ok, Some(7), Some(2))
    );
    assert_eq!(db.balance(&key).await, balance(10 - PRICE, 0));
}

#[tokio::test]
async fn what_has_no_chat_equivalent_is_refused_before_any_charge_and_built_in_tools_are_named() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, catalogue(&provider, "")).await;
    let key = db.funded_key(10, 0).await;

    let mut body = messages(MODEL, false);
    body["top_k"] = json!(5);
    let answer = gateway
        .post_x_api_key(MESSAGES, &key, body.to_string())
        .await;
    assert_eq!(answer.status, 400, "{answer:?}");
    assert!(answer.detail().contains("top_k"), "{}", answer.detail());

    // Anthropic's own tools are dropped by default, and named.
    let mut body = messages(MODEL, false);
    body["tools"]
        .as_array_mut()
        .unwrap()
        .push(json!({ "type": "web_search_20250305", "name": "web_search" }));
    provider.then(Fault::json(200, CHAT_REPLY));
    let answer = gateway
        .post_x_api_key(MESSAGES, &key, body.to_string())
        .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(
        answer.headers["x-gateway-dropped-tools"],
        "web_search_20250305"
    );
    let chat: Value = serde_json::from_slice(&provider.last().body).unwrap();
    assert_eq!(chat["tools"].as_array().unwrap().len(), 1);
    let [entry] = db.calls(&key).await.try_into().unwrap();
    assert_eq!(entry.dropped_tools.as_deref(), Some("web_search_20250305"));

    assert_eq!(provider.requests(), 1, "the refused call never reached it");
    assert_eq!(db.calls(&key).await.len(), 1);
    assert_eq!(db.balance(&key).await, balance(10 - PRICE, 0));
}

#[tokio::test]
async fn a_provider_failure_is_a_502_in_the_contracts_shape_and_refunded() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, catalogue(&provider, "")).await;
    let key = db.funded_key(10, 0).await;
    provider.then(Fault::json(500, r#"{"error":{"message":"boom"}}"#));
    let answer = gateway
        .post_x_api_key(MESSAGES, &key, messages(MODEL, false).to_string())
        .await;
    assert_eq!(
        (answer.status, answer.body.clone()),
        (502, json!({ "detail": "上游服务暂时不可用" }))
    );
    // A reply that is not a chat completion is the provider's failure too.
    provider.then(Fault::json(200, r#"{"unexpected":true}"#));
    let answer = gateway
        .post_x_api_key(MESSAGES, &key, messages(MODEL, false).to_string())
        .await;
    assert_eq!(answer.status, 502, "{answer:?}");
    let calls = db.calls(&key).await;
    assert!(
        calls.iter().all(|call| call.status == CallStatus::Refunded),
        "{calls:?}"
    );
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

/// The gateway's error event in Anthropic's shape ends the stream.
fn assert_ends_with_the_gateways_error_event(received: &Streamed) {
    let last = received.data().pop().unwrap();
    assert_eq!(
        (last["type"].as_str(), last["error"]["message"].as_str()),
        (Some("error"), Some("上游服务暂时不可用")),
        "{}",
        received.text()
    );
    assert_eq!(names(received).last().map(String::as_str), Some("error"));
}

/// A translated stream cut, failed by the provider, or ended without `[DONE]` after content:
/// the client gets the gateway's error event in Anthropic's shape, and the call is refunded.
async fn assert_failed_translated_streams_are_refunded(db: TestDb) {
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, catalogue(&provider, "")).await;
    let key = db.funded_key(10, 0).await;
    let body = messages(MODEL, true);

    provider.then(Fault::sse([ROLE, DELTA, "data: {\"choi"]).ending(StreamEnd::Cut));
    let received = stream(&gateway, MESSAGES, &key, body.clone()).await;
    assert_eq!(received.joined_text(), "Hi");
    assert_ends_with_the_gateways_error_event(&received);
    let error = "data: {\"error\":{\"message\":\"The server had an error\"}}\n\n";
    provider.then(Fault::sse([ROLE, DELTA, error]).ending(StreamEnd::Hang));
    let received = stream(&gateway, MESSAGES, &key, body.clone()).await;
    assert!(!received.text().contains("The server had an error"));
    assert_ends_with_the_gateways_error_event(&received);
    provider.then(Fault::sse([ROLE, DELTA, FINISH]));
    let received = stream(&gateway, MESSAGES, &key, body).await;
    assert!(!received.text().contains("message_stop"));

    assert_three_failed_streams_refunded(db, &key, "The server had an error").await;
}

/// The account of `key` made three calls whose streams failed, the second by the provider's
/// error `error`: each refunded, its credits back, the books balanced.
async fn assert_three_failed_streams_refunded(db: TestDb, key: &str, error: &str) {
    let calls = db.calls(key).await;
    assert_eq!(calls.len(), 3);
    assert!(
        calls.iter().all(|call| call.status == CallStatus::Refunded),
        "{calls:?}"
    );
    assert!(calls[1].upstream_error.as_deref().unwrap().contains(error));
    assert_eq!(db.balance(key).await, balance(10, 0));
    db.assert_audit_holds().await;
    db.drop_schema().await;
}

/// A client that calls `path` with `body` while the provider sends `events` and then nothing:
/// it reads until `wanted` arrives and leaves, and the provider's stream is dropped; the call
/// it made, once finished.
async fn leave_when(
    gateway: &Gateway,
    provider: &FakeProvider,
    db: &TestDb,
    key: &str,
    (path, body): (&str, &Value),
    events: Fault,
    wanted: &str,
) -> model_gateway::store::CallRecord {
    let hung_up = provider.hung_up();
    provider.then(events.ending(StreamEnd::Hang));
    let mut response = gateway
        .client
        .post(format!("{}{path}", gateway.base))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap();
    let mut received = String::new();
    while !received.contains(wanted) {
        let chunk = response.chunk().await.unwrap().unwrap();
        received.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    drop(response);
    assert!(
        provider
            .wait_hung_up(hung_up + 1, Duration::from_secs(5))
            .await
    );
    finished_call(db, key).await
}

backends!(
    async fn failed_translated_streams_are_refunded(db) {
        assert_failed_translated_streams_are_refunded(db).await;
    }
);

/// A client that leaves a translated stream: billed once content reached it, refunded before.
async fn assert_a_client_leaving_a_translated_stream_is_billed_only_after_content(db: TestDb) {
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, catalogue(&provider, "")).await;
    let key = db.funded_key(10, 0).await;
    let tool_call = "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"\"}}]}}]}\n\n";
    for (events, wanted, billed) in [
        (vec![ROLE], "event: ping", false),
        (vec![ROLE, DELTA], "text_delta", true),
        (vec![ROLE, tool_call], "tool_use", true),
    ] {
        let body = messages(MODEL, true);
        let fault = Fault::sse(events.clone());
        let entry = leave_when(
            &gateway,
            &provider,
            &db,
            &key,
            (MESSAGES, &body),
            fault,
            wanted,
        )
        .await;
        if billed {
            assert_eq!(entry.status, CallStatus::Ok, "{events:?}");
            assert_eq!(entry.upstream_protocol, Some(Protocol::ChatCompletions));
        } else {
            assert_eq!(
                (entry.status, entry.upstream_error.as_deref()),
                (CallStatus::Refunded, Some(CLIENT_LEFT_BEFORE_CONTENT)),
                "{events:?}"
            );
        }
    }
    assert_eq!(db.balance(&key).await, balance(10 - 2 * PRICE, 0));
    db.assert_audit_holds().await;
    db.drop_schema().await;
}

backends!(
    async fn a_client_leaving_a_translated_stream_is_billed_only_after_content(db) {
        assert_a_client_leaving_a_translated_stream_is_billed_only_after_content(db).await;
    }
);

// --- The same credits whichever endpoint -------------------------------------------------------

/// A chat body and a messages body asking the same, the chat one padded with spaces to the
/// messages one's length: where a provider reports no input, both are charged the estimate
/// from the request's size, which is then the same.
/// The question is long enough for the usages below to fit within the call's reservation.
fn same_size_bodies(stream: bool) -> (String, String) {
    let question = "Hello there. ".repeat(1_000);
    let messages = json!({
        "model": METERED, "max_tokens": 100, "stream": stream,
        "messages": [{ "role": "user", "content": question }],
    })
    .to_string();
    let mut chat = json!({
        "model": METERED, "max_tokens": 100, "stream": stream,
        "messages": [{ "role": "user", "content": question }],
    })
    .to_string();
    assert!(chat.len() <= messages.len());
    chat.pop();
    chat.push_str(&" ".repeat(messages.len() - chat.len() - 1));
    chat.push('}');
    assert_eq!(chat.len(), messages.len());
    (chat, messages)
}

fn chat_reply(usage: Option<Value>) -> String {
    let mut reply = json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{ "index": 0, "message": { "role": "assistant", "content": "Hello there, friend" }, "finish_reason": "stop" }],
    });
    if let Some(usage) = usage {
        reply["usage"] = usage;
    }
    reply.to_string()
}

fn chat_stream(usage: Option<Value>) -> Vec<String> {
    let mut events = vec![
        ROLE.to_owned(),
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello there, \"}}]}\n\n"
            .to_owned(),
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"friend\"}}]}\n\n".to_owned(),
        FINISH.to_owned(),
    ];
    if let Some(usage) = usage {
        events.push(format!(
            "data: {}\n\n",
            json!({ "choices": [], "usage": usage })
        ));
    }
    events.push(DONE.to_owned());
    events
}

/// What a call cost and what its entry recorded of each kind of token.
fn billed(entry: &model_gateway::store::CallRecord) -> [Option<i64>; 7] {
    [
        Some(entry.price.get()),
        entry.input_tokens,
        entry.output_tokens,
        entry.cache_read_tokens,
        entry.cache_write_tokens,
        entry.cache_write_1h_tokens,
        entry.reasoning_tokens,
    ]
}

/// For each shape a chat provider's usage takes (cached input and reasoning; cache writes;
/// counts that are no counts; none at all), complete and streamed (its usage only at the end),
/// the messages call is charged exactly what the chat call is, and its entry records the same
/// tokens. The peers' bugs this rules out: cached tokens counted twice when `OpenAI` usage is
/// mapped to Anthropic's shape (`LiteLLM` #38176), translated streams metered at zero (otari
/// #256), a missing usage billed as zero tokens.
#[tokio::test]
async fn the_same_provider_usage_costs_the_same_credits_by_either_endpoint() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, catalogue(&provider, "")).await;
    let key = db.funded_key(100_000, 0).await;
    let shapes = [
        (
            "cached input and reasoning",
            Some(json!({
                "prompt_tokens": 3000, "completion_tokens": 40, "total_tokens": 3040,
                "prompt_tokens_details": { "cached_tokens": 2500 },
                "completion_tokens_details": { "reasoning_tokens": 25 },
            })),
        ),
        (
            "cache writes beside cache reads",
            Some(json!({
                "prompt_tokens": 900, "completion_tokens": 12,
                "prompt_tokens_details": { "cached_tokens": 300 },
                "cache_creation_input_tokens": 400,
            })),
        ),
        (
            "a count that is no count",
            Some(json!({ "prompt_tokens": "many", "completion_tokens": 12 })),
        ),
        ("no usage at all", None),
    ];
    let mut charged = Vec::new();
    let mut responses_spent = 0;
    for (shape, usage) in shapes {
        for streamed in [false, true] {
            let (chat_body, messages_body) = same_size_bodies(streamed);
            let mut entries = Vec::new();
            for (path, body) in [(CHAT, chat_body), (MESSAGES, messages_body)] {
                let fault = if streamed {
                    Fault::sse(chat_stream(usage.clone()))
                } else {
                    Fault::json(200, &chat_reply(usage.clone()))
                };
                provider.then(fault);
                let answer = gateway.post_bearer(path, &key, body).await;
                assert_eq!(answer.status, 200, "{shape} {path}: {answer:?}");
                let entry = finished_call(&db, &key).await;
                assert_eq!(entry.status, CallStatus::Ok, "{shape} {path}");
                entries.push(billed(&entry));
            }
            assert_eq!(
                entries[0], entries[1],
                "{shape}, streamed {streamed}: [credits, input, output, cache read, 5m write, 1h write, reasoning]"
            );
            charged.push((shape, streamed, entries[0][0]));
            // The Responses call, translated to chat completions too: the same tokens and, but
            // where the charge rests on the request (a Responses request is shorter), the same
            // credits. Its streams were billed by the usage the translation wrote for the
            // client, which turned a count that is no count into 0 (charged as no input).
            let responses = json!({
                "model": METERED, "max_output_tokens": 100, "stream": streamed,
                "input": "Hello there. ".repeat(1_000),
            });
            provider.then(if streamed {
                Fault::sse(chat_stream(usage.clone()))
            } else {
                Fault::json(200, &chat_reply(usage.clone()))
            });
            let answer = gateway
                .post_bearer("/v1/responses", &key, responses.to_string())
                .await;
            assert_eq!(answer.status, 200, "{shape} responses: {answer:?}");
            let entry = finished_call(&db, &key).await;
            assert_eq!(
                entry.usage_rejected,
                shape == "a count that is no count",
                "{shape}, streamed {streamed}, responses"
            );
            let by_responses = billed(&entry);
            if matches!(shape, "no usage at all" | "a count that is no count") {
                assert_eq!(
                    by_responses[1..],
                    entries[0][1..],
                    "{shape}, streamed {streamed}"
                );
            } else {
                assert_eq!(by_responses, entries[0], "{shape}, streamed {streamed}");
            }
            responses_spent += by_responses[0].unwrap();
        }
    }
    // The shapes cost what their usage says (each kind at its rate, rounded up once): not all
    // alike, and none free.
    let cost = |shape: &str, streamed: bool| {
        charged
            .iter()
            .find(|(name, s, _)| *name == shape && *s == streamed)
            .unwrap()
            .2
            .unwrap()
    };
    // 500 input at 0.1, 2500 cache reads at 0.05, 40 output at 0.4 credits per token.
    assert_eq!(cost("cached input and reasoning", false), 50 + 125 + 16);
    // 600 input (the cache writes reported beside `prompt_tokens`, as the chat endpoint reads
    // them), 300 cache reads, 400 cache writes at 0.125, 12 output: 129.8, rounded up.
    assert_eq!(cost("cache writes beside cache reads", true), 130);
    // The reservation: the input the request can hold and 100 output tokens, at their rates.
    assert!(cost("a count that is no count", false) > 191);
    assert!(cost("no usage at all", true) > 0);
    let balance_now = db.balance(&key).await;
    let spent: i64 = charged.iter().map(|(_, _, cost)| 2 * cost.unwrap()).sum();
    assert_eq!(balance_now, balance(100_000 - spent - responses_spent, 0));
}

/// Every rule of every call holds on a translated call, the budgets first (a peer skipped them
/// on its translated endpoint, otari #256): a key's spending limit stops it, its model rule
/// refuses it, an idempotency key replays it uncharged, its request id reaches the provider.
#[tokio::test]
async fn a_translated_call_keeps_every_rule_of_every_call() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, catalogue(&provider, "")).await;
    let key = db.funded_key(100, 0).await;
    let id = db.caller(&key).await.key;
    let admin = model_gateway::admin::Admin::new(db.store.clone());
    let limit = model_gateway::admin::KeyPatch {
        limit: Some(Some(model_gateway::call::KeyLimit {
            credits: model_gateway::Credits::new(PRICE + 1),
            period: model_gateway::call::LimitPeriod::Day,
        })),
        ..model_gateway::admin::KeyPatch::default()
    };
    admin.update_key(id, &limit).await.unwrap();
    let keyed = |idem: &'static str| {
        gateway
            .client
            .post(format!("{}{MESSAGES}", gateway.base))
            .header("x-api-key", &key)
            .header("content-type", "application/json")
            .header("x-request-id", format!("req-{idem}"))
            .header("idempotency-key", idem)
            .body(messages(MODEL, false).to_string())
    };
    provider.always(Fault::json(200, CHAT_REPLY));
    let first = gateway.send(keyed("one")).await;
    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(provider.last().header("x-request-id"), Some("req-one"));
    let again = gateway.send(keyed("one")).await;
    assert_eq!(again.bytes, first.bytes, "replayed, ids and all");
    assert_eq!(provider.requests(), 1);
    let over = gateway.send(keyed("two")).await;
    assert_eq!(
        (over.status, over.detail()),
        (402, "API Key 额度已用尽"),
        "the limit holds on the translated endpoint"
    );
    let only_claude = model_gateway::admin::KeyPatch {
        models: Some(Some(vec![MESSAGES_MODEL.into()])),
        limit: Some(None),
        ..model_gateway::admin::KeyPatch::default()
    };
    admin.update_key(id, &only_claude).await.unwrap();
    let refused = gateway.send(keyed("three")).await;
    assert_eq!(refused.status, 403, "{refused:?}");
    assert_eq!(provider.requests(), 1);
    assert_eq!(db.calls(&key).await.len(), 1);
    assert_eq!(db.balance(&key).await, balance(100 - PRICE, 0));
    db.assert_audit_holds().await;
}

/// `count_tokens` for a model no Anthropic provider serves is counted by the gateway (the
/// provider is never asked), grows with the request, and refuses what does not translate.
#[tokio::test]
async fn count_tokens_of_a_translated_model_is_counted_locally() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, catalogue(&provider, "")).await;
    let key = db.funded_key(10, 0).await;
    let count = async |body: Value| {
        gateway
            .post_x_api_key("/v1/messages/count_tokens", &key, body.to_string())
            .await
    };
    let short = count(messages(MODEL, false)).await;
    assert_eq!(short.status, 200, "{short:?}");
    let short = short.body["input_tokens"].as_u64().unwrap();
    let mut longer = messages(MODEL, false);
    longer["messages"][0]["content"] = json!("Paris? ".repeat(100));
    let longer = count(longer).await.body["input_tokens"].as_u64().unwrap();
    assert!(short > 0 && longer > short + 90, "{short} then {longer}");
    let mut image = messages(MODEL, false);
    image["messages"][0]["content"] = json!([
        { "type": "image", "source": { "type": "url", "url": "https://example.com/a.png" } },
        { "type": "text", "text": "Paris?" },
    ]);
    let image = count(image).await.body["input_tokens"].as_u64().unwrap();
    assert!(image >= short + 1_600, "{image}");
    let mut refused = messages(MODEL, false);
    refused["top_k"] = json!(3);
    let refused = count(refused).await;
    assert_eq!(refused.status, 400);
    assert!(refused.detail().contains("top_k"));
    assert_eq!(provider.requests(), 0);
    assert!(db.calls(&key).await.is_empty(), "free, as counting is");
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

/// A messages client on a translated call reads refusals in Anthropic's shape where the
/// operator asks for compatible bodies, the `detail` text the same: a field that does not
/// translate (also when counting tokens), and the provider's failure.
#[tokio::test]
async fn a_translated_calls_errors_are_in_the_clients_protocol() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, catalogue(&provider, "error_body = \"compatible\"")).await;
    let key = db.funded_key(10, 0).await;
    let mut body = messages(MODEL, false);
    body["top_k"] = json!(5);
    for path in [MESSAGES, "/v1/messages/count_tokens"] {
        let refused = gateway.post_x_api_key(path, &key, body.to_string()).await;
        assert_eq!(refused.status, 400, "{path}");
        let detail = refused.detail().to_owned();
        assert!(detail.contains("top_k"), "{detail}");
        assert_eq!(
            (
                refused.body["type"].as_str(),
                refused.body["error"]["message"].as_str()
            ),
            (Some("error"), Some(detail.as_str())),
            "{path}: {:?}",
            refused.body
        );
        assert_eq!(refused.body["error"]["type"], "invalid_request_error");
    }
    provider.then(Fault::json(500, r#"{"error":{"message":"boom"}}"#));
    let failed = gateway
        .post_x_api_key(MESSAGES, &key, messages(MODEL, false).to_string())
        .await;
    assert_eq!(failed.status, 502);
    assert_eq!(failed.detail(), "上游服务暂时不可用");
    assert_eq!(failed.body["type"], "error");
    assert_eq!(failed.body["error"]["message"], "上游服务暂时不可用");
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

/// A translated stream whose provider goes quiet past the idle time-out after content: the
/// client gets the gateway's error event in Anthropic's shape, and the call is refunded.
#[tokio::test]
async fn a_translated_stream_quiet_past_its_idle_time_out_is_refunded() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, catalogue(&provider, "stream_idle_timeout_secs = 1")).await;
    let key = db.funded_key(10, 0).await;
    provider.then(Fault::sse([ROLE, DELTA]).ending(StreamEnd::Hang));
    let started = std::time::Instant::now();
    let received = stream(&gateway, MESSAGES, &key, messages(MODEL, true)).await;
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert_eq!(received.joined_text(), "Hi");
    assert_ends_with_the_gateways_error_event(&received);
    let entry = db.calls(&key).await.remove(0);
    assert_eq!(entry.status, CallStatus::Refunded);
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

// --- OpenAI clients on an Anthropic model --------------------------------------------------------

/// A Claude model answering on chat completions and Responses too, served by an Anthropic
/// provider, priced per call and by tokens.
const CLAUDE: &str = "claude-on-chat";
const CLAUDE_PRICE: i64 = 3;
const METERED_CLAUDE: &str = "metered-claude-on-chat";

fn claude_catalogue(provider: &FakeProvider, settings: &str) -> Catalogue {
    Catalogue::from_toml(&format!(
        r#"
        streaming = true
        {settings}

        [[upstreams]]
        name = "messages-only"
        kind = "anthropic"
        base_url = "{}"
        api_key_env = "K"

        [[models]]
        name = "{CLAUDE}"
        protocol = "messages"
        endpoints = ["messages", "chat_completions", "responses"]
        price = {CLAUDE_PRICE}
        upstream = "messages-only"
        upstream_model = "claude-sonnet-5-5"
        max_output_tokens = 2048

        [[models]]
        name = "{METERED_CLAUDE}"
        protocol = "messages"
        endpoints = ["messages", "chat_completions", "responses"]
        upstream = "messages-only"
        max_output_tokens = 1000
        context_window = 100000
        [models.tokens]
        input = 100000
        output = 500000
        cache_read = 10000
        cache_write = 125000
        cache_write_1h = 200000
        "#,
        provider.base
    ))
    .unwrap()
}

const MESSAGE_REPLY: &str = r#"{"id":"msg_1","type":"message","role":"assistant","model":"claude-sonnet-5-5","content":[{"type":"text","text":"Checking."},{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{"city":"Paris"}}],"stop_reason":"tool_use","stop_sequence":null,"usage":{"input_tokens":21,"cache_read_input_tokens":4,"output_tokens":9}}"#;

fn anthropic_event(name: &str, data: Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

fn message_events(usage_at_start: Value, usage_at_end: Value) -> Vec<String> {
    vec![
        anthropic_event(
            "message_start",
            json!({ "type": "message_start", "message": { "id": "msg_s", "type": "message", "role": "assistant", "model": "claude-sonnet-5-5", "content": [], "stop_reason": null, "stop_sequence": null, "usage": usage_at_start } }),
        ),
        anthropic_event(
            "content_block_start",
            json!({ "type": "content_block_start", "index": 0, "content_block": { "type": "text", "text": "" } }),
        ),
        anthropic_event("ping", json!({ "type": "ping" })),
        anthropic_event(
            "content_block_delta",
            json!({ "type": "content_block_delta", "index": 0, "delta": { "type": "text_delta", "text": "Hello there, " } }),
        ),
        anthropic_event(
            "content_block_delta",
            json!({ "type": "content_block_delta", "index": 0, "delta": { "type": "text_delta", "text": "friend" } }),
        ),
        anthropic_event(
            "content_block_stop",
            json!({ "type": "content_block_stop", "index": 0 }),
        ),
        anthropic_event(
            "message_delta",
            json!({ "type": "message_delta", "delta": { "stop_reason": "end_turn", "stop_sequence": null }, "usage": usage_at_end }),
        ),
        anthropic_event("message_stop", json!({ "type": "message_stop" })),
    ]
}

fn chat_question(model: &str, stream: bool) -> Value {
    json!({
        "model": model, "stream": stream,
        "messages": [{ "role": "system", "content": "Use tools." }, { "role": "user", "content": "Paris?" }],
        "tools": [{ "type": "function", "function": { "name": "get_weather", "parameters": { "type": "object" } } }],
    })
}

#[tokio::test]
async fn a_chat_call_on_an_anthropic_provider_is_translated_both_ways_and_billed_once() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, claude_catalogue(&provider, "")).await;
    let key = db.funded_key(10, 0).await;

    provider.then(Fault::json(200, MESSAGE_REPLY));
    let answer = gateway
        .post_bearer(CHAT, &key, chat_question(CLAUDE, false).to_string())
        .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let seen = provider.last();
    assert_eq!(seen.target, "/v1/messages");
    assert_eq!(seen.header("x-api-key"), Some("sk-provider"));
    assert_eq!(seen.header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(seen.header("authorization"), None);
    let sent: Value = serde_json::from_slice(&seen.body).unwrap();
    assert_eq!(sent["model"], "claude-sonnet-5-5");
    assert_eq!(sent["max_tokens"], 2048, "the model's max_output_tokens");
    assert_eq!(
        sent["system"],
        json!([{ "type": "text", "text": "Use tools." }])
    );
    assert_eq!(sent["tools"][0]["name"], "get_weather");
    let completion = &answer.body;
    assert_eq!(completion["object"], "chat.completion");
    assert_eq!(completion["model"], CLAUDE);
    assert!(completion["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let message = &completion["choices"][0]["message"];
    assert_eq!(message["content"], "Checking.");
    assert_eq!(
        message["tool_calls"][0],
        json!({ "id": "toolu_1", "type": "function", "function": { "name": "get_weather", "arguments": "{\"city\":\"Paris\"}" } })
    );
    assert_eq!(completion["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(
        completion["usage"],
        json!({ "prompt_tokens": 25, "completion_tokens": 9, "total_tokens": 34, "prompt_tokens_details": { "cached_tokens": 4 } })
    );
    let [entry] = db.calls(&key).await.try_into().unwrap();
    assert_eq!(
        (entry.protocol, entry.status, entry.channel.as_deref()),
        (
            Protocol::ChatCompletions,
            CallStatus::Ok,
            Some("messages-only")
        )
    );
    assert_eq!(entry.upstream_protocol, Some(Protocol::Messages));
    assert_eq!(
        (
            entry.input_tokens,
            entry.cache_read_tokens,
            entry.output_tokens
        ),
        (Some(21), Some(4), Some(9))
    );
    assert_eq!(db.balance(&key).await, balance(10 - CLAUDE_PRICE, 0));
}

#[tokio::test]
async fn a_messages_stream_arrives_as_chat_chunks_its_usage_shown_only_when_asked() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, claude_catalogue(&provider, "")).await;
    let key = db.funded_key(10, 0).await;
    let events = || {
        message_events(
            json!({ "input_tokens": 12, "output_tokens": 1 }),
            json!({ "output_tokens": 5 }),
        )
    };
    for asks in [false, true] {
        provider.then(Fault::sse(events()).spaced(Duration::from_millis(2)));
        let mut body = chat_question(CLAUDE, true);
        if asks {
            body["stream_options"] = json!({ "include_usage": true });
        }
        let received = stream(&gateway, CHAT, &key, body).await;
        assert_eq!(received.status, 200);
        assert_eq!(received.joined_text(), "Hello there, friend");
        assert!(received.text().ends_with("data: [DONE]\n\n"));
        let data = received.data();
        let finish = data
            .iter()
            .find_map(|chunk| chunk["choices"][0]["finish_reason"].as_str());
        assert_eq!(finish, Some("stop"));
        let usage = data.iter().find(|chunk| chunk["usage"].is_object());
        assert_eq!(usage.is_some(), asks, "{}", received.text());
        if let Some(usage) = usage {
            assert_eq!(
                usage["usage"],
                json!({ "prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17 })
            );
        }
        let entry = finished_call(&db, &key).await;
        assert_eq!(
            (entry.status, entry.input_tokens, entry.output_tokens),
            (CallStatus::Ok, Some(12), Some(5)),
            "the usage is recorded whether the client asked for it or not"
        );
    }
    assert_eq!(db.balance(&key).await, balance(10 - 2 * CLAUDE_PRICE, 0));
}

#[tokio::test]
async fn a_responses_call_on_an_anthropic_provider_goes_through_chat_completions_both_ways() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, claude_catalogue(&provider, "")).await;
    let key = db.funded_key(10, 0).await;
    provider.then(Fault::json(200, MESSAGE_REPLY));
    let body = json!({
        "model": CLAUDE, "instructions": "Use tools.", "input": "Paris?",
        "tools": [{ "type": "function", "name": "get_weather", "parameters": { "type": "object" } }],
    });
    let answer = gateway
        .post_bearer("/v1/responses", &key, body.to_string())
        .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let sent: Value = serde_json::from_slice(&provider.last().body).unwrap();
    assert_eq!(provider.last().target, "/v1/messages");
    assert_eq!(
        sent["system"],
        json!([{ "type": "text", "text": "Use tools." }])
    );
    assert_eq!(
        sent["tools"][0]["input_schema"],
        json!({ "type": "object" })
    );
    let response = &answer.body;
    assert_eq!(response["object"], "response");
    assert_eq!(response["output"][0]["content"][0]["text"], "Checking.");
    let call = &response["output"][1];
    assert_eq!(
        (
            call["type"].as_str(),
            call["call_id"].as_str(),
            call["arguments"].as_str()
        ),
        (
            Some("function_call"),
            Some("toolu_1"),
            Some("{\"city\":\"Paris\"}")
        )
    );
    assert_eq!(
        response["usage"]["input_tokens_details"]["cached_tokens"],
        4
    );

    provider.then(Fault::sse(message_events(
        json!({ "input_tokens": 12, "output_tokens": 1 }),
        json!({ "output_tokens": 5 }),
    )));
    let mut body = body;
    body["stream"] = json!(true);
    let received = stream(&gateway, "/v1/responses", &key, body).await;
    let text: String = received
        .data()
        .iter()
        .filter(|event| event["type"] == "response.output_text.delta")
        .map(|event| event["delta"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(text, "Hello there, friend");
    let last = received.data().pop().unwrap();
    assert_eq!(last["type"], "response.completed");
    assert_eq!(last["response"]["usage"]["output_tokens"], 5);
    let calls = db.calls(&key).await;
    assert!(
        calls
            .iter()
            .all(|call| call.protocol == Protocol::Responses && call.status == CallStatus::Ok)
    );
    assert_eq!(db.balance(&key).await, balance(10 - 2 * CLAUDE_PRICE, 0));
}

/// A chat stream from an Anthropic provider cut, failed by the provider, or ended without
/// `message_stop`, after content: the client gets the gateway's error chunk, and the call is
/// refunded.
async fn assert_failed_streams_from_anthropic_are_refunded(db: TestDb) {
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, claude_catalogue(&provider, "")).await;
    let key = db.funded_key(10, 0).await;
    let body = chat_question(CLAUDE, true);
    let events = message_events(json!({ "input_tokens": 3 }), json!({ "output_tokens": 2 }));
    let error = anthropic_event(
        "error",
        json!({ "type": "error", "error": { "type": "overloaded_error", "message": "Overloaded" } }),
    );
    let cases = [
        Fault::sse(
            events[..4]
                .iter()
                .chain(["event: content_blo".to_owned()].iter()),
        )
        .ending(StreamEnd::Cut),
        Fault::sse(events[..4].iter().chain([error].iter())).ending(StreamEnd::Hang),
        Fault::sse(&events[..7]),
    ];
    for fault in cases {
        provider.then(fault);
        let received = stream(&gateway, CHAT, &key, body.clone()).await;
        assert!(received.joined_text().starts_with("Hello there, "));
        assert!(!received.text().contains("[DONE]"), "{}", received.text());
    }
    assert_three_failed_streams_refunded(db, &key, "Overloaded").await;
}

backends!(
    async fn failed_streams_from_anthropic_are_refunded(db) {
        assert_failed_streams_from_anthropic_are_refunded(db).await;
    }
);

/// For each shape an Anthropic provider's usage takes (cache reads and both cache writes; the
/// total of the writes only; a count that is no count; none at all), complete and streamed
/// (the output counted only at its end), the chat call and the Responses call are charged
/// exactly what the messages call is, and their entries record the same tokens.
#[tokio::test]
async fn the_same_anthropic_usage_costs_the_same_credits_by_every_endpoint() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, claude_catalogue(&provider, "")).await;
    let key = db.funded_key(100_000, 0).await;
    let question = "Hello there. ".repeat(1_000);
    let shapes = [
        (
            "cache reads and both writes",
            Some(
                json!({ "input_tokens": 500, "cache_read_input_tokens": 2000, "cache_creation_input_tokens": 300, "cache_creation": { "ephemeral_5m_input_tokens": 100, "ephemeral_1h_input_tokens": 200 }, "output_tokens": 40 }),
            ),
        ),
        (
            "the total of the writes only",
            Some(
                json!({ "input_tokens": 200, "cache_creation_input_tokens": 400, "output_tokens": 12 }),
            ),
        ),
        (
            "a count that is no count",
            Some(json!({ "input_tokens": "many", "output_tokens": 12 })),
        ),
        ("no usage at all", None),
    ];
    for (shape, usage) in shapes {
        for streamed in [false, true] {
            let mut entries = Vec::new();
            for path in [MESSAGES, CHAT, "/v1/responses"] {
                let body = match path {
                    MESSAGES => {
                        json!({ "model": METERED_CLAUDE, "max_tokens": 100, "stream": streamed, "messages": [{ "role": "user", "content": question }] })
                    }
                    CHAT => {
                        json!({ "model": METERED_CLAUDE, "max_tokens": 100, "stream": streamed, "messages": [{ "role": "user", "content": question }] })
                    }
                    _ => {
                        json!({ "model": METERED_CLAUDE, "max_output_tokens": 100, "stream": streamed, "input": question })
                    }
                };
                let fault = if streamed {
                    let (start, end) = match &usage {
                        Some(usage) => (json!({}), usage.clone()),
                        None => (json!({}), json!({})),
                    };
                    Fault::sse(message_events(start, end))
                } else {
                    let mut reply = json!({ "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [{ "type": "text", "text": "Hello there, friend" }], "stop_reason": "end_turn", "stop_sequence": null });
                    if let Some(usage) = &usage {
                        reply["usage"] = usage.clone();
                    }
                    Fault::json(200, &reply.to_string())
                };
                provider.then(fault);
                let answer = gateway.post_bearer(path, &key, body.to_string()).await;
                assert_eq!(answer.status, 200, "{shape} {path}: {answer:?}");
                let entry = finished_call(&db, &key).await;
                assert_eq!(entry.status, CallStatus::Ok, "{shape} {path}");
                entries.push((path, billed(&entry)));
            }
            let (_, by_messages) = entries[0];
            for (path, billed) in &entries[1..] {
                let rests_on_the_request =
                    matches!(shape, "no usage at all" | "a count that is no count");
                if rests_on_the_request && *path != CHAT {
                    // Charged the estimate of the request's input, or its ceiling, from the
                    // request the client sent: a Responses request is shorter than the
                    // messages one (the chat one is as long). The tokens are the same.
                    assert_eq!(
                        billed[1..],
                        by_messages[1..],
                        "{shape}, streamed {streamed}, {path}"
                    );
                } else {
                    assert_eq!(
                        *billed, by_messages,
                        "{shape}, streamed {streamed}, {path}: [credits, input, output, cache read, 5m write, 1h write, reasoning]"
                    );
                }
            }
        }
    }
}

/// A client that leaves a chat stream translated from an Anthropic provider: billed once
/// content reached it, refunded before.
async fn assert_a_client_leaving_a_stream_from_anthropic_is_billed_only_after_content(db: TestDb) {
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, claude_catalogue(&provider, "")).await;
    let key = db.funded_key(10, 0).await;
    let events = message_events(json!({ "input_tokens": 3 }), json!({ "output_tokens": 2 }));
    for (sent, wanted, billed) in [
        (2, "\"role\":\"assistant\"", false),
        (4, "Hello there", true),
    ] {
        let body = chat_question(CLAUDE, true);
        let fault = Fault::sse(events[..sent].iter());
        let entry = leave_when(&gateway, &provider, &db, &key, (CHAT, &body), fault, wanted).await;
        if billed {
            assert_eq!(entry.status, CallStatus::Ok);
            assert_eq!(entry.upstream_protocol, Some(Protocol::Messages));
        } else {
            assert_eq!(
                (entry.status, entry.upstream_error.as_deref()),
                (CallStatus::Refunded, Some(CLIENT_LEFT_BEFORE_CONTENT))
            );
        }
    }
    assert_eq!(db.balance(&key).await, balance(10 - CLAUDE_PRICE, 0));
    db.assert_audit_holds().await;
    db.drop_schema().await;
}

backends!(
    async fn a_client_leaving_a_stream_from_anthropic_is_billed_only_after_content(db) {
        assert_a_client_leaving_a_stream_from_anthropic_is_billed_only_after_content(db).await;
    }
);

/// An OpenAI client on a model whose provider speaks only messages reads refusals in
/// `OpenAI`'s shape where the operator asks for compatible bodies, the `detail` text the same: a
/// field that does not translate (refused before any charge), and the provider's failure.
#[tokio::test]
async fn an_openai_clients_translated_call_errors_in_openais_shape() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(
        &db,
        claude_catalogue(&provider, "error_body = \"compatible\""),
    )
    .await;
    let key = db.funded_key(10, 0).await;
    let mut body = chat_question(CLAUDE, false);
    body["seed"] = json!(7);
    let refused = gateway.post_bearer(CHAT, &key, body.to_string()).await;
    assert_eq!(refused.status, 400, "{refused:?}");
    let detail = refused.detail().to_owned();
    assert!(detail.contains("seed"), "{detail}");
    assert_eq!(refused.body["error"]["message"], detail.as_str());
    assert_eq!(refused.body["error"]["type"], "invalid_request_error");
    assert!(refused.body.get("type").is_none(), "not Anthropic's shape");
    assert_eq!(provider.requests(), 0);

    provider.then(Fault::json(
        529,
        r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
    ));
    let failed = gateway
        .post_bearer(CHAT, &key, chat_question(CLAUDE, false).to_string())
        .await;
    assert_eq!(failed.status, 502, "{failed:?}");
    assert_eq!(failed.detail(), "上游服务暂时不可用");
    assert_eq!(failed.body["error"]["message"], "上游服务暂时不可用");
    assert_eq!(db.balance(&key).await, balance(10, 0));
}
