//! `POST /v1/responses` over real HTTP: the translation corpus, the mock's replies, a native
//! upstream's reply and stream byte for byte, a translating upstream's request, reply and
//! stream, the refusals before any charge, and every way a stream ends, billed or refunded
//! exactly once on `SQLite`, `PostgreSQL` and `MariaDB`.

use crate::common;
use crate::streaming::{Streamed, finished_call, leave_after, stream};

use std::time::Duration;

use common::fake_provider::{FakeProvider, Fault, StreamEnd};
use common::*;
use model_gateway::protocol::responses::{
    Ids, StreamTranslator, Translated, chat_request, response_from_chat,
    response_json_from_chat_bytes,
};
use model_gateway::{
    Catalogue, Protocol, Upstream, refund::CLIENT_LEFT_BEFORE_CONTENT,
    router::DEFAULT_MAX_BODY_BYTES, store::CallStatus, upstream::MOCK_REPLY_TEXT,
    upstream::MockUpstream,
};
use serde_json::{Value, json};

const RESPONSES: &str = "/v1/responses";

// --- The translation corpus --------------------------------------------------------------------

fn corpus() -> Vec<(String, Value)> {
    let dir = format!("{}/tests/corpus/responses", env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let case = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
            (name, case)
        })
        .collect()
}

/// The Responses events in server-sent event text, each checked to name its `type` in its
/// `event:` line.
fn events(text: &str) -> Vec<Value> {
    text.split_terminator("\n\n")
        .map(|event| {
            let (name, data) = event.split_once('\n').unwrap();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(
                name.strip_prefix("event: "),
                data["type"].as_str(),
                "{event}"
            );
            data
        })
        .collect()
}

/// `request` translated from its bytes, as the gateway reads it.
fn translated(request: &Value) -> Translated {
    Translated::from_slice(&serde_json::to_vec(request).unwrap()).unwrap()
}

/// Each corpus request translates to its chat request both ways: parsed, and read from its bytes
/// (compact, and pretty-printed, whose line breaks the reading keeps out of what it writes).
#[test]
fn the_corpus_requests_translate_to_the_chat_requests_written_for_them() {
    let mut checked = 0;
    for (name, case) in corpus() {
        let Some(expected) = case.get("chat_request") else {
            continue;
        };
        let model = case["model"].as_str().unwrap();
        assert_eq!(
            &chat_request(&case["request"], model).unwrap(),
            expected,
            "{name}"
        );
        for bytes in [
            serde_json::to_vec(&case["request"]).unwrap(),
            serde_json::to_vec_pretty(&case["request"]).unwrap(),
        ] {
            let translated = Translated::from_slice(&bytes).unwrap();
            let chat: Value = serde_json::from_slice(&translated.chat_body(model)).unwrap();
            assert_eq!(&chat, expected, "{name}, from bytes");
        }
        checked += 1;
    }
    assert_eq!(checked, 11);
}

#[test]
fn the_corpus_chat_replies_translate_to_the_responses_written_for_them() {
    let mut checked = 0;
    for (name, case) in corpus() {
        let (Some(reply), Some(expected)) = (case.get("chat_reply"), case.get("response")) else {
            continue;
        };
        let parsed = Translated::new(case["request"].clone()).unwrap();
        let response = response_from_chat(&parsed, reply, &mut Ids::counting());
        assert_eq!(&response, expected, "{name}");
        // The request and the reply read from their bytes, as a translating upstream reads
        // them: the same response.
        let bytes = serde_json::to_vec(reply).unwrap();
        let (from_bytes, _) = response_json_from_chat_bytes(
            &translated(&case["request"]),
            &bytes,
            &mut Ids::counting(),
        )
        .unwrap();
        let from_bytes: Value = serde_json::from_slice(&from_bytes).unwrap();
        assert_eq!(&from_bytes, expected, "{name}, from bytes");
        checked += 1;
    }
    assert_eq!(checked, 5);
}

/// Replies with escapes, odd types and missing parts each translate into a well-formed
/// `response`: what is of an unexpected type is skipped, each output item has an id and a
/// known type, and a reply without a usable `created` is stamped with the time.
#[test]
fn a_chat_reply_with_odd_types_or_missing_parts_translates_into_a_well_formed_response() {
    let request = translated(
        &json!({ "model": "m", "input": "Hi", "tools": [{ "type": "function", "name": "f" }] }),
    );
    let replies = [
        r#"{"created":7,"model":"m","choices":[{"message":{"content":"caf\u00e9 \"quoted\"\n","reasoning_content":"hm"},"finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":3},"completion_tokens_details":{"reasoning_tokens":1}}}"#,
        r#"{"created":7,"choices":[{"message":{"content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}},{"function":{"name":"g"}}]},"finish_reason":"tool_calls"}],"usage":null}"#,
        r#"{"created":7,"choices":[{"message":{"content":[{"type":"text","text":"parts"}],"refusal":"no"}}],"usage":{"prompt_tokens":"5"}}"#,
        r#"{"created":"soon","model":3,"choices":"none"}"#,
        r#"{"created":7,"choices":[],"usage":{}}"#,
        r#"{"created":7,"choices":[{"message":{"content":"","reasoning_content":"","reasoning":"r"}}]}"#,
        r#"{"created":7,"choices":[{"message":{"content":null,"tool_calls":[{"id":"c1","type":"custom","custom":{"name":"p","input":"*** \u4e16\n"}},{"custom":{"name":"q"}},{"type":"custom"},{"type":"function","custom":{"name":"r"},"function":{"name":"f"}},{"custom":null,"function":{"name":"g"}}]},"finish_reason":"tool_calls"}]}"#,
        r#"{"created":7,"choices":[{"message":{"tool_calls":[{"type":"custom","custom":{"name":"p","input":5}},{"type":["custom"]}]}}]}"#,
    ];
    let kinds = ["message", "reasoning", "function_call", "custom_tool_call"];
    for reply in replies {
        let value: Value = serde_json::from_str(reply).unwrap();
        let (response, _) =
            response_json_from_chat_bytes(&request, reply.as_bytes(), &mut Ids::counting())
                .unwrap();
        let response: Value = serde_json::from_slice(&response).unwrap();
        assert_eq!(response["object"], "response", "{reply}");
        assert!(response["status"].is_string(), "{reply}");
        let created = response["created_at"].as_i64().unwrap();
        match value["created"].as_i64() {
            Some(given) => assert_eq!(created, given, "{reply}"),
            None => assert!(created > 1_700_000_000, "{reply}"),
        }
        for item in response["output"].as_array().unwrap() {
            assert!(kinds.contains(&item["type"].as_str().unwrap()), "{reply}");
            assert!(item["id"].is_string(), "{reply}");
        }
    }
}

#[test]
fn the_corpus_chat_streams_translate_to_the_event_sequences_written_for_them_however_cut() {
    let mut checked = 0;
    for (name, case) in corpus() {
        let Some(chunks) = case.get("chat_stream") else {
            continue;
        };
        let chat: String = chunks
            .as_array()
            .unwrap()
            .iter()
            .map(|chunk| format!("{}\n\n", chunk.as_str().unwrap()))
            .collect();
        let expected = case["events"].as_array().unwrap();
        let whole = translate(&case["request"], &[chat.as_bytes()]);
        assert_eq!(&events(&whole), expected, "{name}");
        // Cut anywhere (inside a UTF-8 character, between `\n`s), the output is the same.
        for cut in 1..chat.len() {
            let (head, tail) = chat.as_bytes().split_at(cut);
            assert_eq!(
                translate(&case["request"], &[head, tail]),
                whole,
                "{name} cut at {cut}"
            );
        }
        let byte_by_byte: Vec<&[u8]> = chat.as_bytes().chunks(1).collect();
        assert_eq!(translate(&case["request"], &byte_by_byte), whole, "{name}");
        checked += 1;
    }
    assert_eq!(checked, 5);
}

fn translate(request: &Value, chunks: &[&[u8]]) -> String {
    let mut translator = StreamTranslator::new(&translated(request), Ids::counting());
    chunks.iter().map(|chunk| translator.push(chunk)).collect()
}

#[test]
fn what_has_no_chat_equivalent_is_refused_naming_the_field() {
    let (_, case) = corpus()
        .into_iter()
        .find(|(name, _)| name == "refusals.json")
        .unwrap();
    let cases = case["cases"].as_array().unwrap();
    assert!(cases.len() >= 15);
    for case in cases {
        let refused = chat_request(&case["request"], "m").unwrap_err();
        assert_eq!(refused.field, case["field"].as_str().unwrap(), "{case}");
        // Read from its bytes: the same refusal.
        let bytes = serde_json::to_vec(&case["request"]).unwrap();
        assert_eq!(
            Translated::from_slice(&bytes).unwrap_err(),
            refused,
            "{case}"
        );
    }
}

// --- The mock ----------------------------------------------------------------------------------

/// POSTs `body` to `/v1/responses` with `key`.
async fn post_responses(gateway: &Gateway, key: &str, body: &Value) -> Answer {
    gateway.post_bearer(RESPONSES, key, body.to_string()).await
}

fn responses_body(model: &str, stream: bool) -> Value {
    json!({ "model": model, "instructions": "Be brief.", "input": "Hello", "stream": stream })
}

async fn mock_gateway(db: &TestDb) -> Gateway {
    start_gateway(
        db,
        Catalogue::demo().with_streaming(true),
        Upstream::Mock(MockUpstream::new()),
        DEFAULT_MAX_BODY_BYTES,
    )
    .await
}

/// The text of a stream's `response.output_text.delta` events, joined.
fn delta_text(received: &Streamed) -> String {
    received
        .data()
        .iter()
        .filter(|data| data["type"] == "response.output_text.delta")
        .map(|data| data["delta"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn the_mock_answers_a_response_and_a_stream_charged_as_chat_calls_and_logged_as_responses() {
    let db = local_db().await;
    let gateway = mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;

    let answer = post_responses(&gateway, &key, &responses_body(CHAT_MODEL, false)).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.body["object"], "response");
    assert_eq!(answer.body["status"], "completed");
    assert_eq!(answer.body["instructions"], "Be brief.");
    assert_eq!(
        answer.body["output"][0]["content"][0]["text"],
        MOCK_REPLY_TEXT
    );
    assert!(answer.body["usage"]["output_tokens"].as_u64().unwrap() > 0);

    let received = stream(&gateway, RESPONSES, &key, responses_body(CHAT_MODEL, true)).await;
    assert_eq!(received.status, 200);
    let data = received.data();
    assert_eq!(data[0]["type"], "response.created");
    let deltas = data
        .iter()
        .filter(|data| data["type"] == "response.output_text.delta")
        .count();
    assert!(deltas > 1, "{}", received.text());
    assert_eq!(delta_text(&received), MOCK_REPLY_TEXT);
    let last = data.last().unwrap();
    assert_eq!(last["type"], "response.completed");
    assert!(last["response"]["usage"]["input_tokens"].as_u64().unwrap() > 0);
    let numbers: Vec<u64> = data
        .iter()
        .map(|data| data["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(numbers, (0..data.len() as u64).collect::<Vec<_>>());

    assert_eq!(db.balance(&key).await, balance(10 - 2 * CHAT_PRICE, 0));
    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), 2);
    for call in &calls {
        assert_eq!(
            (call.protocol, call.model.as_str(), call.status),
            (Protocol::Responses, CHAT_MODEL, CallStatus::Ok)
        );
        assert!(call.output_tokens.unwrap() > 0, "{call:?}");
    }
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_responses_call_gets_the_request_id_idempotency_and_key_rules_of_every_call() {
    assert_the_rules_of_every_call(RESPONSES, &responses_body(CHAT_MODEL, false), CHAT_PRICE).await;
}

#[tokio::test]
async fn refusals_come_before_any_charge_in_the_contracts_order() {
    let db = local_db().await;
    let gateway = mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let post = async |key: &str, body: Value| post_responses(&gateway, key, &body).await;

    let unknown_key = post("sk-mg-nope", responses_body(CHAT_MODEL, false)).await;
    assert_eq!(
        (unknown_key.status, unknown_key.detail()),
        (401, "无效的 API Key")
    );
    for body in [
        json!({ "model": CHAT_MODEL }),
        json!({ "model": CHAT_MODEL, "input": 5 }),
        json!({ "input": "x" }),
        json!({ "model": CHAT_MODEL, "input": "x", "stream": "yes" }),
    ] {
        assert_eq!(post(&key, body.clone()).await.status, 400, "{body}");
    }
    // Not JSON, though only reading its text finds it: a lone escaped surrogate, in a text the
    // translation copies as written.
    let lone =
        format!(r#"{{"model":"{CHAT_MODEL}","input":[{{"role":"user","content":"\ud800"}}]}}"#);
    let lone = gateway.post_bearer(RESPONSES, &key, lone).await;
    assert_eq!(
        (lone.status, lone.detail()),
        (400, "请求体不是有效的 JSON 对象")
    );
    // A messages model does not exist here, as on the chat endpoint.
    let messages_model = post(&key, responses_body(MESSAGES_MODEL, false)).await;
    assert_eq!(
        (messages_model.status, messages_model.detail()),
        (404, "模型不存在")
    );
    let unknown = post(&key, responses_body("no-such-model", false)).await;
    assert_eq!(unknown.status, 404);
    // What a translating upstream cannot do: 400 naming the field (a built-in tool itself is
    // dropped, see `built_in_tools_are_dropped_and_named_or_refused_before_any_charge`; a
    // choice that forces one cannot be).
    let forced = json!({ "model": CHAT_MODEL, "input": "x", "tools": [{ "type": "web_search" }],
                         "tool_choice": { "type": "web_search" } });
    let refused = post(&key, forced).await;
    assert_eq!(refused.status, 400);
    assert!(
        refused.detail().contains("tool_choice"),
        "{}",
        refused.detail()
    );
    let background = post(
        &key,
        json!({ "model": CHAT_MODEL, "input": "x", "background": true }),
    )
    .await;
    assert!(background.detail().contains("background"));
    let continued = json!({ "model": CHAT_MODEL, "input": "x", "previous_response_id": "resp_1" });
    let continued = post(&key, continued).await;
    assert_eq!(continued.status, 400);
    assert!(continued.detail().contains("previous_response_id"));

    assert_eq!(db.balance(&key).await, balance(10, 0));
    assert!(db.calls(&key).await.is_empty());
    // And only then the price: 402 with too few credits.
    let poor = db.funded_key(1, 0).await;
    let unpaid = post(&poor, responses_body(CHAT_MODEL, false)).await;
    assert_eq!((unpaid.status, unpaid.detail()), (402, "积分不足"));
}

#[tokio::test]
async fn streaming_stays_off_for_responses_unless_switched_on() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let answer = post_responses(&gateway, &key, &responses_body(CHAT_MODEL, true)).await;
    assert_eq!(answer.status, 400);
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

// --- Native and translating upstreams ---------------------------------------------------------

/// A streaming catalogue whose chat model is served, in this order, by OpenAI-kind upstreams
/// at these providers, each with its `responses` setting (and the channel's own model name).
fn catalogue(providers: &[(&FakeProvider, &str)]) -> Catalogue {
    catalogue_with(providers, "")
}

/// [`catalogue`] with these top-level `settings`.
fn catalogue_with(providers: &[(&FakeProvider, &str)], settings: &str) -> Catalogue {
    let mut toml = format!("streaming = true\n{settings}\n");
    let mut channels = Vec::new();
    for (i, (provider, responses)) in providers.iter().enumerate() {
        toml.push_str(&format!(
            "[[upstreams]]\nname = \"p{i}\"\nkind = \"openai\"\nbase_url = \"{}/v1\"\napi_key_env = \"K\"\nresponses = \"{responses}\"\n",
            provider.base
        ));
        channels.push(format!(
            "{{ name = \"p{i}\", priority = {i}, upstream_model = \"upstream-{i}\" }}"
        ));
    }
    toml.push_str(&format!(
        "[[models]]\nname = \"{CHAT_MODEL}\"\nprotocol = \"chat_completions\"\nprice = {CHAT_PRICE}\nupstreams = [{}]\n",
        channels.join(", ")
    ));
    Catalogue::from_toml(&toml).unwrap()
}

const NATIVE_REPLY: &str = r#"{"id":"resp_native","object":"response","created_at":1741476542,"status":"completed","model":"gpt-4o-mini-2024-07-18","output":[{"type":"message","id":"msg_n","status":"completed","role":"assistant","content":[{"type":"output_text","text":"Hi!","annotations":[]}]}],"usage":{"input_tokens":11,"input_tokens_details":{"cached_tokens":0},"output_tokens":3,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":14}}"#;

fn native_event(name: &str, data: Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

fn native_created() -> String {
    native_event(
        "response.created",
        json!({ "type": "response.created", "sequence_number": 0, "response": { "id": "resp_native", "status": "in_progress", "output": [] } }),
    )
}

fn native_delta(sequence: u64, delta: &str) -> String {
    native_event(
        "response.output_text.delta",
        json!({ "type": "response.output_text.delta", "sequence_number": sequence, "item_id": "msg_n", "output_index": 0, "content_index": 0, "delta": delta }),
    )
}

fn native_completed(sequence: u64) -> String {
    native_event(
        "response.completed",
        json!({ "type": "response.completed", "sequence_number": sequence, "response": { "id": "resp_native", "status": "completed", "usage": { "input_tokens": 11, "output_tokens": 3, "total_tokens": 14 } } }),
    )
}

#[tokio::test]
async fn a_native_upstream_gets_the_request_and_gives_the_reply_byte_for_byte() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, catalogue(&[(&provider, "native")])).await;
    let key = db.funded_key(10, 0).await;

    provider.then(Fault::json(200, NATIVE_REPLY));
    let sent = r#"{"model": "gpt-4o-mini", "input": [{"role": "user", "content": "Hi"}], "tools": [{"type": "web_search"}], "store": false, "include": ["reasoning.encrypted_content"]}"#;
    let answer = gateway.post_bearer(RESPONSES, &key, sent).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.bytes, NATIVE_REPLY.as_bytes());
    let seen = provider.last();
    assert_eq!(seen.target, "/v1/responses");
    assert_eq!(seen.header("authorization"), Some("Bearer sk-provider"));
    // Only `model` is renamed, to the channel's name; built-in tools go to a native upstream.
    assert_eq!(
        String::from_utf8(seen.body).unwrap(),
        sent.replace("\"gpt-4o-mini\"", "\"upstream-0\"")
    );

    let events = [
        native_created(),
        native_delta(1, "Hi"),
        native_delta(2, "!"),
        native_completed(3),
    ];
    provider.then(Fault::sse(&events));
    let received = stream(&gateway, RESPONSES, &key, responses_body(CHAT_MODEL, true)).await;
    assert_eq!(received.text(), events.concat());

    let calls = db.calls(&key).await;
    for call in &calls {
        assert_eq!(call.status, CallStatus::Ok);
        assert_eq!((call.input_tokens, call.output_tokens), (Some(11), Some(3)));
        assert_eq!(call.protocol, Protocol::Responses);
    }
    assert_eq!(calls.len(), 2);
    assert_eq!(db.balance(&key).await, balance(10 - 2 * CHAT_PRICE, 0));
}

const CHAT_REPLY: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1741476542,"model":"upstream-0","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":21,"completion_tokens":9,"total_tokens":30}}"#;

#[tokio::test]
async fn a_translating_upstream_gets_a_chat_request_and_its_reply_comes_back_as_a_response() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, catalogue(&[(&provider, "translate")])).await;
    let key = db.funded_key(10, 0).await;

    provider.then(Fault::json(200, CHAT_REPLY));
    let tool =
        json!({ "type": "function", "name": "get_weather", "parameters": { "type": "object" } });
    let body = json!({ "model": CHAT_MODEL, "instructions": "Use tools.", "input": "Paris?", "tools": [tool] });
    let answer = post_responses(&gateway, &key, &body).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let seen = provider.last();
    assert_eq!(seen.target, "/v1/chat/completions");
    let chat: Value = serde_json::from_slice(&seen.body).unwrap();
    assert_eq!(chat["model"], "upstream-0");
    assert_eq!(
        chat["messages"][0],
        json!({ "role": "system", "content": "Use tools." })
    );
    assert_eq!(chat["tools"][0]["function"]["name"], "get_weather");
    let call = &answer.body["output"][0];
    assert_eq!(
        (
            call["type"].as_str(),
            call["call_id"].as_str(),
            call["arguments"].as_str()
        ),
        (
            Some("function_call"),
            Some("call_1"),
            Some("{\"city\":\"Paris\"}")
        )
    );
    assert!(answer.body["id"].as_str().unwrap().starts_with("resp_"));
    let [entry] = db.calls(&key).await.try_into().unwrap();
    assert_eq!(
        (entry.input_tokens, entry.output_tokens),
        (Some(21), Some(9))
    );
    assert_eq!(db.balance(&key).await, balance(10 - CHAT_PRICE, 0));
}

const CHAT_ROLE: &str =
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n";
const CHAT_DELTA: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n";
const CHAT_FINISH: &str =
    "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n";
const CHAT_USAGE: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2,\"total_tokens\":9}}\n\n";

#[tokio::test]
async fn a_translating_upstream_streams_chat_chunks_that_arrive_as_responses_events() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, catalogue(&[(&provider, "translate")])).await;
    let key = db.funded_key(10, 0).await;
    provider.then(
        Fault::sse([
            CHAT_ROLE,
            CHAT_DELTA,
            CHAT_DELTA,
            CHAT_FINISH,
            CHAT_USAGE,
            "data: [DONE]\n\n",
        ])
        .spaced(Duration::from_millis(5)),
    );
    let received = stream(&gateway, RESPONSES, &key, responses_body(CHAT_MODEL, true)).await;
    let chat: Value = serde_json::from_slice(&provider.last().body).unwrap();
    assert_eq!(chat["stream_options"], json!({ "include_usage": true }));
    assert_eq!(delta_text(&received), "HiHi");
    let last = received.data().pop().unwrap();
    assert_eq!(last["type"], "response.completed");
    assert_eq!(last["response"]["usage"]["output_tokens"], 2);
    let entry = finished_call(&db, &key).await;
    assert_eq!(
        (entry.status, entry.output_tokens),
        (CallStatus::Ok, Some(2))
    );
    assert_eq!(db.balance(&key).await, balance(10 - CHAT_PRICE, 0));
}

#[tokio::test]
async fn a_failed_responses_call_fails_over_across_both_kinds_and_is_refunded_when_all_fail() {
    let db = local_db().await;
    let (native, translating) = (FakeProvider::start().await, FakeProvider::start().await);
    let catalogue = catalogue(&[(&native, "native"), (&translating, "translate")]);
    let gateway = http_gateway(&db, catalogue).await;
    let key = db.funded_key(10, 0).await;
    let body = responses_body(CHAT_MODEL, false).to_string();

    native.then(Fault::json(500, r#"{"error":{"message":"down"}}"#));
    translating.then(Fault::json(200, CHAT_REPLY));
    let answer = gateway.post_bearer(RESPONSES, &key, body.clone()).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body["object"], "response");
    assert_eq!(translating.last().target, "/v1/chat/completions");
    assert_eq!(db.calls(&key).await[0].channel.as_deref(), Some("p1"));

    native.always(Fault::json(503, r#"{"error":{"message":"down"}}"#));
    translating.always(Fault::json(500, r#"{"error":{"message":"down"}}"#));
    let failed = gateway.post_bearer(RESPONSES, &key, body).await;
    assert_eq!(
        (failed.status, failed.detail()),
        (502, "上游服务暂时不可用")
    );
    assert_eq!(db.calls(&key).await[0].status, CallStatus::Refunded);
    assert_eq!(db.balance(&key).await, balance(10 - CHAT_PRICE, 0));
    db.assert_audit_holds().await;
}

/// Codex's default request: a function tool, a namespace of tools and web search.
fn with_built_in_tools() -> Value {
    json!({
        "model": CHAT_MODEL,
        "input": "Hello",
        "tools": [
            { "type": "function", "name": "shell", "parameters": { "type": "object" } },
            { "type": "namespace", "name": "multi_agent_v1", "tools": [
                { "type": "function", "name": "spawn_agent", "parameters": { "type": "object" } },
            ] },
            { "type": "web_search", "external_web_access": false },
        ],
    })
}

/// By default a translating upstream drops built-in tools: the call goes on without them
/// (mock mode too, which Codex's default request used to leave at a 400), billed once, and the
/// reply names them in `x-gateway-dropped-tools`. An upstream set to refuse them refuses the
/// call, naming the first, before any charge, whichever other channel would drop them.
#[tokio::test]
async fn built_in_tools_are_dropped_and_named_or_refused_before_any_charge() {
    let db = local_db().await;
    let key = db.funded_key(10, 0).await;
    let mock = mock_gateway(&db).await;
    let answer = post_responses(&mock, &key, &with_built_in_tools()).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.headers["x-gateway-dropped-tools"], "web_search");
    assert_eq!(db.balance(&key).await, balance(10 - CHAT_PRICE, 0));

    let (dropping, refusing) = (FakeProvider::start().await, FakeProvider::start().await);
    dropping.always(Fault::json(200, CHAT_REPLY));
    let upstream = |name: &str, provider: &FakeProvider, builtin: &str| {
        format!(
            "[[upstreams]]\nname = \"{name}\"\nkind = \"openai\"\nbase_url = \"{}/v1\"\n\
             api_key_env = \"K\"\nbuiltin_tools = \"{builtin}\"\n",
            provider.base
        )
    };
    let model = |upstreams: &str| {
        format!(
            "[[models]]\nname = \"{CHAT_MODEL}\"\nprotocol = \"chat_completions\"\n\
             price = {CHAT_PRICE}\nupstreams = [{upstreams}]\n"
        )
    };
    let dropping_only = Catalogue::from_toml(&format!(
        "{}{}",
        upstream("drops", &dropping, "drop"),
        model("\"drops\"")
    ))
    .unwrap();
    let gateway = http_gateway(&db, dropping_only).await;
    let answer = post_responses(&gateway, &key, &with_built_in_tools()).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.headers["x-gateway-dropped-tools"], "web_search");
    let sent: Value = serde_json::from_slice(&dropping.last().body).unwrap();
    let names: Vec<_> = sent["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|tool| tool["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["shell", "multi_agent_v1__spawn_agent"], "{sent}");
    assert_eq!(db.balance(&key).await, balance(10 - 2 * CHAT_PRICE, 0));

    let both = Catalogue::from_toml(&format!(
        "{}{}{}",
        upstream("drops", &dropping, "drop"),
        upstream("refuses", &refusing, "refuse"),
        model("\"drops\", \"refuses\"")
    ))
    .unwrap();
    let gateway = http_gateway(&db, both).await;
    let requests = dropping.requests();
    let refused = post_responses(&gateway, &key, &with_built_in_tools()).await;
    assert_eq!(refused.status, 400);
    assert!(
        refused.detail().contains("tools[2].type"),
        "{}",
        refused.body
    );
    assert!(refused.headers.get("x-gateway-dropped-tools").is_none());
    assert_eq!((dropping.requests(), refusing.requests()), (requests, 0));
    assert_eq!(db.balance(&key).await, balance(10 - 2 * CHAT_PRICE, 0));
    assert_eq!(db.calls(&key).await.len(), 2);
    db.assert_audit_holds().await;
}

// --- How a stream ends, on every database ------------------------------------------------------

/// The gateway's own last event: the Responses `error` event, numbered after the last event
/// the client got.
fn assert_ends_with_the_gateways_error_event(received: &Streamed, sequence: u64) {
    let last = received.data().pop().unwrap();
    assert_eq!(
        (
            last["type"].as_str(),
            last["message"].as_str(),
            last["sequence_number"].as_u64()
        ),
        (Some("error"), Some("上游服务暂时不可用"), Some(sequence)),
        "{}",
        received.text()
    );
    assert!(received.text().ends_with("\n\n"));
}

/// A stream cut, or failed by the provider, after content: the client gets the gateway's error
/// event in the Responses shape, and the call is refunded, on both kinds of upstream.
async fn assert_failed_responses_streams_are_refunded(db: TestDb) {
    let (native, translating) = (FakeProvider::start().await, FakeProvider::start().await);
    let native_gateway = http_gateway(&db, catalogue(&[(&native, "native")])).await;
    let translating_gateway = http_gateway(&db, catalogue(&[(&translating, "translate")])).await;
    let key = db.funded_key(10, 0).await;
    let body = responses_body(CHAT_MODEL, true);

    native.then(Fault::sse([native_created(), native_delta(1, "Hi")]).ending(StreamEnd::Cut));
    let received = stream(&native_gateway, RESPONSES, &key, body.clone()).await;
    assert_ends_with_the_gateways_error_event(&received, 2);
    let failed = native_event(
        "response.failed",
        json!({ "type": "response.failed", "sequence_number": 2, "response": { "id": "resp_native", "status": "failed", "error": { "code": "server_error", "message": "The model failed" } } }),
    );
    native.then(
        Fault::sse([native_created(), native_delta(1, "Hi"), failed]).ending(StreamEnd::Hang),
    );
    let received = stream(&native_gateway, RESPONSES, &key, body.clone()).await;
    assert!(!received.text().contains("The model failed"));
    assert_ends_with_the_gateways_error_event(&received, 2);
    let entry = db.calls(&key).await.remove(0);
    assert_eq!(entry.status, CallStatus::Refunded);
    assert!(entry.upstream_error.unwrap().contains("The model failed"));

    // Translated: created, in progress, item, part, delta are 0 to 4.
    translating.then(Fault::sse([CHAT_ROLE, CHAT_DELTA, "data: {\"choi"]).ending(StreamEnd::Cut));
    let received = stream(&translating_gateway, RESPONSES, &key, body.clone()).await;
    assert_eq!(delta_text(&received), "Hi");
    assert_ends_with_the_gateways_error_event(&received, 5);
    let chat_error =
        "data: {\"error\":{\"message\":\"The server had an error\",\"type\":\"server_error\"}}\n\n";
    translating.then(Fault::sse([CHAT_ROLE, CHAT_DELTA, chat_error]).ending(StreamEnd::Hang));
    let received = stream(&translating_gateway, RESPONSES, &key, body.clone()).await;
    assert!(!received.text().contains("The server had an error"));
    assert_ends_with_the_gateways_error_event(&received, 5);
    // A chat stream that ends without `[DONE]` never completed: refunded too.
    translating.then(Fault::sse([CHAT_ROLE, CHAT_DELTA, CHAT_FINISH]));
    let received = stream(&translating_gateway, RESPONSES, &key, body).await;
    assert!(!received.text().contains("response.completed"));

    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), 5);
    assert!(
        calls.iter().all(|call| call.status == CallStatus::Refunded),
        "{calls:?}"
    );
    assert_eq!(db.balance(&key).await, balance(10, 0));
    db.assert_audit_holds().await;
    db.drop_schema().await;
}

#[tokio::test]
async fn a_responses_stream_quiet_past_its_idle_time_out_is_refunded_with_an_error_event() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let settings = "stream_idle_timeout_secs = 1";
    let gateway = http_gateway(&db, catalogue_with(&[(&provider, "translate")], settings)).await;
    let key = db.funded_key(10, 0).await;
    provider.then(Fault::sse([CHAT_ROLE, CHAT_DELTA]).ending(StreamEnd::Hang));
    let started = std::time::Instant::now();
    let received = stream(&gateway, RESPONSES, &key, responses_body(CHAT_MODEL, true)).await;
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert_eq!(delta_text(&received), "Hi");
    assert_ends_with_the_gateways_error_event(&received, 5);
    let entry = db.calls(&key).await.remove(0);
    assert_eq!(entry.status, CallStatus::Refunded);
    assert!(
        entry.upstream_error.unwrap().contains("no event"),
        "the reason"
    );
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

backends!(
    async fn failed_responses_streams_are_refunded(db) {
        assert_failed_responses_streams_are_refunded(db).await;
    }
);

/// A client that leaves a Responses stream: billed once content reached it (a text delta, or a
/// function call opening), refunded before.
async fn assert_a_client_leaving_a_responses_stream_is_billed_only_after_content(db: TestDb) {
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, catalogue(&[(&provider, "native")])).await;
    let key = db.funded_key(10, 0).await;
    let call_added = native_event(
        "response.output_item.added",
        json!({ "type": "response.output_item.added", "sequence_number": 1, "output_index": 0, "item": { "type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": "" } }),
    );
    let message_added = native_event(
        "response.output_item.added",
        json!({ "type": "response.output_item.added", "sequence_number": 1, "output_index": 0, "item": { "type": "message", "id": "msg_1", "role": "assistant", "content": [] } }),
    );
    for (events, billed) in [
        (vec![native_created()], false),
        (vec![native_created(), message_added], false),
        (vec![native_created(), native_delta(1, "Hi")], true),
        (vec![native_created(), call_added], true),
    ] {
        let body = responses_body(CHAT_MODEL, true);
        leave_after(&gateway, &provider, RESPONSES, &key, body, &events).await;
        let entry = finished_call(&db, &key).await;
        if billed {
            assert_eq!(entry.status, CallStatus::Ok, "{events:?}");
        } else {
            assert_eq!(
                (entry.status, entry.upstream_error.as_deref()),
                (CallStatus::Refunded, Some(CLIENT_LEFT_BEFORE_CONTENT)),
                "{events:?}"
            );
        }
    }
    assert_eq!(db.balance(&key).await, balance(10 - 2 * CHAT_PRICE, 0));
    db.assert_audit_holds().await;
    db.drop_schema().await;
}

backends!(
    async fn a_client_leaving_a_responses_stream_is_billed_only_after_content(db) {
        assert_a_client_leaving_a_responses_stream_is_billed_only_after_content(db).await;
    }
);

// --- Stored responses on native upstreams, on every database -----------------------------------

/// A GET (or other `method`) of `path` with `key`.
async fn ask(gateway: &Gateway, method: reqwest::Method, path: &str, key: &str) -> Answer {
    let request = gateway
        .client
        .request(method, format!("{}{path}", gateway.base))
        .bearer_auth(key);
    gateway.send(request).await
}

/// A stored response is reached again (retrieved, its input items listed, cancelled, deleted)
/// only with a key of the account whose call made it, at the upstream that keeps it; any other
/// account, an unknown id and a response made with `store: false` are the same `404`, and the
/// provider is never asked.
async fn assert_a_stored_response_is_reached_only_by_its_account(db: TestDb) {
    let provider = FakeProvider::start().await;
    let gateway = http_gateway(&db, catalogue(&[(&provider, "native")])).await;
    let (owner, other) = (db.funded_key(10, 0).await, db.funded_key(10, 0).await);

    provider.then(Fault::json(200, NATIVE_REPLY));
    let made = post_responses(&gateway, &owner, &responses_body(CHAT_MODEL, false)).await;
    assert_eq!(made.status, 200);
    // Another account's call answered with the same id changes nothing: the first record stands.
    provider.then(Fault::json(200, NATIVE_REPLY));
    let again = post_responses(&gateway, &other, &responses_body(CHAT_MODEL, false)).await;
    assert_eq!(again.status, 200);

    for (method, path) in [
        (reqwest::Method::GET, "/v1/responses/resp_native"),
        (
            reqwest::Method::GET,
            "/v1/responses/resp_native/input_items?limit=2",
        ),
        (reqwest::Method::POST, "/v1/responses/resp_native/cancel"),
        (reqwest::Method::DELETE, "/v1/responses/resp_native"),
    ] {
        let asked = provider.requests();
        let refused = ask(&gateway, method.clone(), path, &other).await;
        assert_eq!(
            (refused.status, refused.detail()),
            (404, "响应不存在"),
            "{path}"
        );
        assert_eq!(
            provider.requests(),
            asked,
            "the provider was asked for another's response"
        );

        let answer = format!(r#"{{"id":"resp_native","asked":"{method} {path}"}}"#);
        provider.then(Fault::json(200, &answer));
        let reached = ask(&gateway, method.clone(), path, &owner).await;
        assert_eq!(reached.status, 200, "{path}");
        assert_eq!(reached.bytes, answer.as_bytes());
        let seen = provider.last();
        assert_eq!(
            (seen.method.as_str(), seen.target.as_str()),
            (method.as_str(), path)
        );
        assert_eq!(seen.header("authorization"), Some("Bearer sk-provider"));
    }
    let unknown = ask(
        &gateway,
        reqwest::Method::GET,
        "/v1/responses/resp_other",
        &owner,
    )
    .await;
    assert_eq!(unknown.status, 404);
    let without_key = gateway
        .send(
            gateway
                .client
                .get(format!("{}/v1/responses/resp_native", gateway.base)),
        )
        .await;
    assert_eq!(without_key.status, 401);

    // `store: false`: the provider keeps nothing, and neither does the gateway.
    let unkept = NATIVE_REPLY.replace("resp_native", "resp_unkept");
    provider.then(Fault::json(200, &unkept));
    let body = json!({ "model": CHAT_MODEL, "input": "Hi", "store": false }).to_string();
    assert_eq!(
        gateway.post_bearer(RESPONSES, &owner, body).await.status,
        200
    );
    let asked = provider.requests();
    let gone = ask(
        &gateway,
        reqwest::Method::GET,
        "/v1/responses/resp_unkept",
        &owner,
    )
    .await;
    assert_eq!((gone.status, provider.requests()), (404, asked));

    // A stream's response is recorded from its `response.created`.
    let streamed = native_created().replace("resp_native", "resp_streamed");
    provider.then(Fault::sse([
        streamed,
        native_delta(1, "Hi"),
        native_completed(2),
    ]));
    let received = stream(
        &gateway,
        RESPONSES,
        &owner,
        responses_body(CHAT_MODEL, true),
    )
    .await;
    assert_eq!(received.status, 200);
    provider.then(Fault::json(200, r#"{"id":"resp_streamed"}"#));
    let fetched = ask(
        &gateway,
        reqwest::Method::GET,
        "/v1/responses/resp_streamed",
        &owner,
    )
    .await;
    assert_eq!(fetched.status, 200);
    assert_eq!(provider.last().target, "/v1/responses/resp_streamed");

    // Reaching a stored response is free and writes no call.
    assert_eq!(db.calls(&owner).await.len(), 3);
    assert_eq!(db.balance(&owner).await, balance(10 - 3 * CHAT_PRICE, 0));
    db.assert_audit_holds().await;
    db.drop_schema().await;
}

backends!(
    async fn a_stored_response_is_reached_only_by_its_account(db) {
        assert_a_stored_response_is_reached_only_by_its_account(db).await;
    }
);

/// `previous_response_id` sends the call to the upstream that keeps that response, whatever the
/// channels' order, for the account that made it; another account's id, or an unknown one, is
/// `404` before any charge.
async fn assert_a_continued_response_goes_where_it_is_kept(db: TestDb) {
    let (first, second) = (FakeProvider::start().await, FakeProvider::start().await);
    let gateway = http_gateway(&db, catalogue(&[(&first, "native"), (&second, "native")])).await;
    let (owner, other) = (db.funded_key(10, 0).await, db.funded_key(10, 0).await);

    // Made at the second channel: the first is down for that call.
    first.then(Fault::json(503, r#"{"error":{"message":"down"}}"#));
    second.then(Fault::json(200, NATIVE_REPLY));
    let made = post_responses(&gateway, &owner, &responses_body(CHAT_MODEL, false)).await;
    assert_eq!(made.status, 200);
    assert_eq!(db.calls(&owner).await[0].channel.as_deref(), Some("p1"));

    let continued =
        json!({ "model": CHAT_MODEL, "input": "And then?", "previous_response_id": "resp_native" });
    let (first_asked, second_asked) = (first.requests(), second.requests());
    second.then(Fault::json(
        200,
        &NATIVE_REPLY.replace("resp_native", "resp_next"),
    ));
    let answer = post_responses(&gateway, &owner, &continued).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(
        (first.requests(), second.requests()),
        (first_asked, second_asked + 1)
    );
    let sent: Value = serde_json::from_slice(&second.last().body).unwrap();
    assert_eq!(sent["previous_response_id"], "resp_native");

    for (key, id) in [(&other, "resp_native"), (&owner, "resp_unknown")] {
        let body = json!({ "model": CHAT_MODEL, "input": "x", "previous_response_id": id });
        let refused = post_responses(&gateway, key, &body).await;
        assert_eq!(
            (refused.status, refused.detail()),
            (404, "响应不存在"),
            "{id}"
        );
    }
    assert_eq!(
        (first.requests(), second.requests()),
        (first_asked, second_asked + 1)
    );
    assert!(db.calls(&other).await.is_empty());
    assert_eq!(db.balance(&other).await, balance(10, 0));
    assert_eq!(db.balance(&owner).await, balance(10 - 2 * CHAT_PRICE, 0));
    db.assert_audit_holds().await;
    db.drop_schema().await;
}

backends!(
    async fn a_continued_response_goes_where_it_is_kept(db) {
        assert_a_continued_response_goes_where_it_is_kept(db).await;
    }
);

/// The owners of stored responses are kept for the providers' retention, then forgotten by the
/// upkeep; the first record of an id stands.
async fn assert_response_owners_are_recorded_once_and_forgotten_after_retention(db: TestDb) {
    use model_gateway::store::{ResponseOwner, ResponseOwners};
    let (owner, other) = (db.funded_key(1, 0).await, db.funded_key(1, 0).await);
    let record = |key_account, id: &str| ResponseOwner {
        response_id: id.to_owned(),
        account: key_account,
        upstream: "p0".to_owned(),
    };
    let (owner, other) = (db.account(&owner).await, db.account(&other).await);
    db.store
        .record_response(&record(owner, "resp_a"))
        .await
        .unwrap();
    db.store
        .record_response(&record(other, "resp_a"))
        .await
        .unwrap();
    db.store
        .record_response(&record(other, "resp_b"))
        .await
        .unwrap();
    let found = db.store.response_owner("resp_a").await.unwrap().unwrap();
    assert_eq!(found.account, owner, "the first record stands");
    assert_eq!(db.store.response_owner("resp_c").await.unwrap(), None);

    let an_hour_ago = chrono::Utc::now() - chrono::Duration::hours(1);
    assert_eq!(db.store.forget_responses(an_hour_ago).await.unwrap(), 0);
    let soon = chrono::Utc::now() + chrono::Duration::seconds(5);
    assert_eq!(db.store.forget_responses(soon).await.unwrap(), 2);
    assert_eq!(db.store.response_owner("resp_a").await.unwrap(), None);
    db.drop_schema().await;
}

backends!(
    async fn response_owners_are_recorded_once_and_forgotten_after_retention(db) {
        assert_response_owners_are_recorded_once_and_forgotten_after_retention(db).await;
    }
);

#[tokio::test]
async fn the_memory_store_records_response_owners_once_and_forgets_them_after_retention() {
    use model_gateway::store::{ResponseOwner, ResponseOwners};
    let store = model_gateway::MemoryStore::new();
    let record = |account: i64| ResponseOwner {
        response_id: "resp_a".to_owned(),
        account: model_gateway::AccountId(account),
        upstream: "p0".to_owned(),
    };
    store.record_response(&record(1)).await.unwrap();
    store.record_response(&record(2)).await.unwrap();
    let found = store.response_owner("resp_a").await.unwrap().unwrap();
    assert_eq!(found.account, model_gateway::AccountId(1));
    let an_hour_ago = chrono::Utc::now() - chrono::Duration::hours(1);
    assert_eq!(store.forget_responses(an_hour_ago).await.unwrap(), 0);
    let soon = chrono::Utc::now() + chrono::Duration::seconds(5);
    assert_eq!(store.forget_responses(soon).await.unwrap(), 1);
    assert_eq!(store.response_owner("resp_a").await.unwrap(), None);
}
