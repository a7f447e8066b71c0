//! Streaming (`stream: true` as server-sent events) through the example gateway over real HTTP:
//! the mock's streams, a fake provider's recorded streams byte for byte, failover before the
//! first event, and every way a stream can end, each billed or refunded exactly once on `SQLite`,
//! `PostgreSQL` and `MariaDB`.

use crate::common;
#[path = "streaming/delivery.rs"]
mod delivery;

use std::time::{Duration, Instant};

use common::fake_provider::{FakeProvider, Fault, StreamEnd};
use common::*;
use model_gateway::{
    Catalogue, Upstream, refund::CLIENT_LEFT_BEFORE_CONTENT, router::DEFAULT_MAX_BODY_BYTES,
    store::CallRecord, store::CallStatus, upstream::MOCK_REPLY_TEXT, upstream::MockUpstream,
};
use serde_json::{Value, json};

/// A streamed answer as the client received it: status, content type and every chunk with the
/// time it arrived.
pub(crate) struct Streamed {
    pub(crate) status: u16,
    content_type: String,
    chunks: Vec<(Instant, bytes::Bytes)>,
}

impl Streamed {
    pub(crate) fn bytes(&self) -> Vec<u8> {
        self.chunks
            .iter()
            .flat_map(|(_, chunk)| chunk.to_vec())
            .collect()
    }

    pub(crate) fn content_type(&self) -> &str {
        &self.content_type
    }

    pub(crate) fn text(&self) -> String {
        String::from_utf8(self.bytes()).unwrap()
    }

    /// The `data:` payloads that are JSON, in order (lines ended by `\n` or, as Google's are,
    /// `\r\n`).
    pub(crate) fn data(&self) -> Vec<Value> {
        self.text()
            .replace("\r\n", "\n")
            .split("\n\n")
            .filter_map(|event| {
                let data = event.lines().find_map(|line| line.strip_prefix("data: "))?;
                serde_json::from_str(data).ok()
            })
            .collect()
    }

    /// The text of every text delta, joined, in either protocol.
    pub(crate) fn joined_text(&self) -> String {
        self.data()
            .iter()
            .filter_map(|data| {
                data["delta"]["text"]
                    .as_str()
                    .or(data["choices"][0]["delta"]["content"].as_str())
                    .map(str::to_owned)
            })
            .collect()
    }
}

pub(crate) async fn stream(gateway: &Gateway, path: &str, key: &str, body: Value) -> Streamed {
    let response = gateway
        .client
        .post(format!("{}{path}", gateway.base))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap();
    read_stream(response).await
}

/// A streamed call of the messages model, read to its end.
async fn messages_stream(gateway: &Gateway, key: &str) -> Streamed {
    stream(gateway, MESSAGES, key, messages_stream_body(MESSAGES_MODEL)).await
}

async fn read_stream(mut response: reqwest::Response) -> Streamed {
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|value| value.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let mut chunks = Vec::new();
    while let Some(chunk) = response.chunk().await.unwrap() {
        chunks.push((Instant::now(), chunk));
    }
    Streamed {
        status,
        content_type,
        chunks,
    }
}

fn chat_stream_body(model: &str) -> Value {
    json!({ "model": model, "stream": true, "messages": [{ "role": "user", "content": "Hello" }] })
}

fn messages_stream_body(model: &str) -> Value {
    json!({
        "model": model, "max_tokens": 64, "stream": true,
        "messages": [{ "role": "user", "content": "Hello" }]
    })
}

async fn mock_streaming_gateway(db: &TestDb) -> Gateway {
    start_gateway(
        db,
        Catalogue::demo().with_streaming(true),
        Upstream::Mock(MockUpstream::new()),
        DEFAULT_MAX_BODY_BYTES,
    )
    .await
}

/// A streaming catalogue whose chat model is served by OpenAI-style upstreams and whose
/// messages model by Anthropic-style ones, at these fake providers in priority order.
fn provider_catalogue(providers: &[&FakeProvider], settings: &str) -> Catalogue {
    let mut toml = format!("streaming = true\n{settings}\n");
    for (i, provider) in providers.iter().enumerate() {
        toml.push_str(&format!(
            "[[upstreams]]\nname = \"openai-{i}\"\nkind = \"openai\"\nbase_url = \"{base}/v1\"\napi_key_env = \"K\"\n\
             [[upstreams]]\nname = \"anthropic-{i}\"\nkind = \"anthropic\"\nbase_url = \"{base}\"\napi_key_env = \"K\"\n",
            base = provider.base
        ));
    }
    let channels = |kind: &str| {
        (0..providers.len())
            .map(|i| format!("{{ name = \"{kind}-{i}\", priority = {i} }}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    toml.push_str(&format!(
        "[[models]]\nname = \"{CHAT_MODEL}\"\nprotocol = \"chat_completions\"\nprice = {CHAT_PRICE}\nupstreams = [{}]\n\
         [[models]]\nname = \"{MESSAGES_MODEL}\"\nprotocol = \"messages\"\nprice = {MESSAGES_PRICE}\nupstreams = [{}]\n",
        channels("openai"),
        channels("anthropic")
    ));
    Catalogue::from_toml(&toml).unwrap()
}

/// What most provider tests start from: a database, one fake provider behind a gateway with
/// these catalogue `settings`, and a key with `credits`.
async fn one_provider(settings: &str, credits: i64) -> (TestDb, FakeProvider, Gateway, String) {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = provider_gateway(&db, &[&provider], settings).await;
    let key = db.funded_key(credits, 0).await;
    (db, provider, gateway, key)
}

async fn provider_gateway(db: &TestDb, providers: &[&FakeProvider], settings: &str) -> Gateway {
    let catalogue = provider_catalogue(providers, settings);
    http_gateway(db, catalogue).await
}

/// A client that calls `path` with `body`, the provider sending `events` and then nothing:
/// it reads those events (checked byte for byte) and leaves; the provider's stream must then be
/// dropped within five seconds.
pub(crate) async fn leave_after<E: AsRef<str>>(
    gateway: &Gateway,
    provider: &FakeProvider,
    path: &str,
    key: &str,
    body: Value,
    events: &[E],
) {
    let hung_up = provider.hung_up();
    provider.then(Fault::sse(events.iter().map(AsRef::as_ref)).ending(StreamEnd::Hang));
    let events: String = events.iter().map(AsRef::as_ref).collect();
    let mut response = gateway
        .client
        .post(format!("{}{path}", gateway.base))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut received = Vec::new();
    while received.len() < events.len() {
        received.extend_from_slice(&response.chunk().await.unwrap().unwrap());
    }
    assert_eq!(received, events.as_bytes());
    drop(response);
    assert!(
        provider
            .wait_hung_up(hung_up + 1, Duration::from_secs(5))
            .await,
        "the provider's stream was not dropped when the client left"
    );
}

/// Waits until the account's newest call is no longer `pending` (outcomes written on a
/// spawned task after a client left), at most five seconds.
pub(crate) async fn finished_call(db: &TestDb, key: &str) -> CallRecord {
    let started = Instant::now();
    loop {
        let calls = db.calls(key).await;
        if let Some(call) = calls.first()
            && call.status != CallStatus::Pending
        {
            return call.clone();
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "still pending: {calls:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub(crate) fn corpus(protocol: &str) -> Vec<(String, Vec<u8>)> {
    let dir = format!(
        "{}/tests/corpus/streams/{protocol}",
        env!("CARGO_MANIFEST_DIR")
    );
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(path).unwrap())
        })
        .collect()
}

/// `bytes` cut every `size` bytes, whatever that splits (UTF-8 characters, line endings).
pub(crate) fn cut_every(bytes: &[u8], size: usize) -> Vec<Vec<u8>> {
    bytes.chunks(size).map(<[u8]>::to_vec).collect()
}

const MESSAGES_START: &str = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"m\",\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n";
const MESSAGES_DELTA: &str = "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n";
const CHAT_ROLE: &str =
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n";
const CHAT_DELTA: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n";

// --- The switch and the contract -------------------------------------------------------------

#[tokio::test]
async fn streaming_is_off_unless_switched_on() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(100, 0).await;
    for (path, body) in [
        (CHAT, chat_stream_body(CHAT_MODEL)),
        (MESSAGES, messages_stream_body(MESSAGES_MODEL)),
    ] {
        let answer = gateway.post_bearer(path, &key, body.to_string()).await;
        assert_eq!(answer.status, 400, "{path}");
        assert!(answer.detail().contains("stream"));
    }
    assert!(db.calls(&key).await.is_empty());
}

#[tokio::test]
async fn the_mock_streams_its_reply_in_each_protocols_events_and_bills_it_once() {
    let db = local_db().await;
    let gateway = mock_streaming_gateway(&db).await;
    let key = db.funded_key(100, 0).await;

    let messages = messages_stream(&gateway, &key).await;
    assert_eq!(messages.status, 200);
    assert_eq!(messages.content_type, "text/event-stream");
    assert_eq!(messages.joined_text(), MOCK_REPLY_TEXT);
    let kinds: Vec<_> = messages
        .data()
        .iter()
        .map(|d| d["type"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(kinds.first().unwrap(), "message_start");
    assert_eq!(kinds.last().unwrap(), "message_stop");
    assert!(
        kinds
            .iter()
            .filter(|kind| *kind == "content_block_delta")
            .count()
            > 1
    );

    let mut with_usage = chat_stream_body(CHAT_MODEL);
    with_usage["stream_options"] = json!({ "include_usage": true });
    let chat = stream(&gateway, CHAT, &key, with_usage).await;
    assert_eq!(chat.status, 200);
    assert_eq!(chat.joined_text(), MOCK_REPLY_TEXT);
    assert!(chat.text().ends_with("data: [DONE]\n\n"));
    let chat_plain = stream(&gateway, CHAT, &key, chat_stream_body(CHAT_MODEL)).await;
    assert_eq!(chat_plain.joined_text(), MOCK_REPLY_TEXT);

    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), 3);
    assert!(calls.iter().all(|call| call.status == CallStatus::Ok));
    // Newest first: chat without the usage chunk, chat with it, messages.
    assert_eq!(
        (calls[0].input_tokens, calls[0].output_tokens),
        (None, None)
    );
    // The mock reports the input as the gateway estimates it from each request.
    for call in &calls[1..] {
        assert!(
            call.input_tokens.is_some_and(|tokens| tokens > 0),
            "{call:?}"
        );
        assert_eq!(call.output_tokens, Some(16));
    }
    let spent = MESSAGES_PRICE + 2 * CHAT_PRICE;
    assert_eq!(db.balance(&key).await, balance(100 - spent, 0));
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn refusals_before_the_stream_are_plain_json_in_the_contracts_order() {
    let db = local_db().await;
    let gateway = mock_streaming_gateway(&db).await;
    let poor = db.funded_key(1, 0).await;
    let rich = db.funded_key(100, 0).await;
    let mut no_max_tokens = messages_stream_body(MESSAGES_MODEL);
    no_max_tokens.as_object_mut().unwrap().remove("max_tokens");
    let cases = [
        (
            stranger_key(),
            MESSAGES,
            messages_stream_body(MESSAGES_MODEL),
            401,
        ),
        (rich.clone(), MESSAGES, no_max_tokens, 400),
        (rich.clone(), CHAT, chat_stream_body("no-such-model"), 404),
        (rich.clone(), CHAT, chat_stream_body(MESSAGES_MODEL), 404),
        (poor.clone(), CHAT, chat_stream_body(CHAT_MODEL), 402),
    ];
    for (key, path, body, status) in cases {
        let response = gateway
            .client
            .post(format!("{}{path}", gateway.base))
            .bearer_auth(&key)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), status, "{body}");
        assert_eq!(response.headers()["content-type"], "application/json");
        let detail: Value = response.json().await.unwrap();
        assert!(detail["detail"].is_string(), "{detail}");
    }
    assert!(db.calls(&poor).await.is_empty());
    assert!(db.calls(&rich).await.is_empty());
}

// --- A provider's streams --------------------------------------------------------------------

#[tokio::test]
async fn recorded_streams_reach_the_client_byte_for_byte_however_the_provider_cuts_them() {
    let (db, provider, gateway, key) = one_provider("", 1_000).await;
    let mut streams = 0;
    for (protocol, path, body) in [
        ("messages", MESSAGES, messages_stream_body(MESSAGES_MODEL)),
        ("chat_completions", CHAT, chat_stream_body(CHAT_MODEL)),
    ] {
        for (name, recorded) in corpus(protocol) {
            // Whole, byte by byte's worth of odd cuts, and one event per chunk.
            for size in [recorded.len(), 7, 1] {
                provider.then(Fault::sse(cut_every(&recorded, size)));
                let received = stream(&gateway, path, &key, body.clone()).await;
                assert_eq!(received.status, 200, "{name}");
                assert_eq!(received.bytes(), recorded, "{name} cut every {size} bytes");
                streams += 1;
            }
            let entry = db.calls(&key).await.remove(0);
            assert_eq!(entry.status, CallStatus::Ok, "{name}");
            if protocol == "messages" {
                assert!(
                    entry.output_tokens.is_some_and(|tokens| tokens > 1),
                    "{name}: {entry:?}"
                );
            }
        }
    }
    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), streams);
    assert!(calls.iter().all(|call| call.status == CallStatus::Ok));
    let with_usage = calls
        .iter()
        .find(|call| {
            call.protocol == model_gateway::Protocol::ChatCompletions
                && call.output_tokens.is_some()
        })
        .expect("the chat stream with a usage chunk recorded its usage");
    assert_eq!(
        (with_usage.input_tokens, with_usage.output_tokens),
        (Some(19), Some(10))
    );
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_channel_that_fails_before_the_first_event_is_failed_over() {
    let db = local_db().await;
    let (primary, backup) = (FakeProvider::start().await, FakeProvider::start().await);
    let gateway = provider_gateway(&db, &[&primary, &backup], "").await;
    let key = db.funded_key(100, 0).await;
    let recorded = corpus("chat_completions").remove(0).1;
    let failures = [
        Fault::json(503, r#"{"error":{"message":"overloaded"}}"#),
        // A 2xx that is not an event stream.
        Fault::json(200, r#"{"choices":[]}"#),
        Fault::sse([CHAT_ROLE]).content_type("application/json"),
        // The stream stops before its first event is complete.
        Fault::sse(["data: {\"choi"]).ending(StreamEnd::Cut),
    ];
    for failure in failures {
        primary.then(failure.clone());
        backup.then(Fault::sse([&recorded]));
        let received = stream(&gateway, CHAT, &key, chat_stream_body(CHAT_MODEL)).await;
        assert_eq!(received.status, 200, "{failure:?}");
        assert_eq!(received.bytes(), recorded, "{failure:?}");
        let entry = db.calls(&key).await.remove(0);
        assert_eq!(entry.status, CallStatus::Ok);
        assert_eq!(entry.channel.as_deref(), Some("openai-1"), "{failure:?}");
    }
    assert_eq!(db.balance(&key).await, balance(100 - 4 * CHAT_PRICE, 0));
}

#[tokio::test]
async fn when_every_channel_fails_before_the_first_event_the_client_gets_a_json_502_and_a_refund() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    provider.always(Fault::sse(["event: message_st"]).ending(StreamEnd::Cut));
    let gateway = provider_gateway(&db, &[&provider], "").await;
    let key = db.funded_key(10, 0).await;
    let response = gateway
        .client
        .post(format!("{}{MESSAGES}", gateway.base))
        .bearer_auth(&key)
        .json(&messages_stream_body(MESSAGES_MODEL))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 502);
    assert_eq!(response.headers()["content-type"], "application/json");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["detail"], "上游服务暂时不可用");
    assert_eq!(db.calls(&key).await[0].status, CallStatus::Refunded);
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

#[tokio::test]
async fn events_the_provider_spaces_out_arrive_spaced_out() {
    let (_db, provider, gateway, key) = one_provider("", 10).await;
    let gap = Duration::from_millis(100);
    let events = [
        CHAT_ROLE,
        CHAT_DELTA,
        CHAT_DELTA,
        CHAT_DELTA,
        "data: [DONE]\n\n",
    ];
    provider.then(Fault::sse(events).spaced(gap));
    let received = stream(&gateway, CHAT, &key, chat_stream_body(CHAT_MODEL)).await;
    assert_eq!(received.text(), events.concat());
    // One event per chunk, each arriving when the provider sent it rather than all at the end.
    assert_eq!(received.chunks.len(), events.len());
    for pair in received.chunks.windows(2) {
        let spacing = pair[1].0 - pair[0].0;
        assert!(spacing >= gap / 2, "events bunched: {spacing:?} apart");
    }
}

// --- How a stream ends, on every database ----------------------------------------------------

/// The provider cuts the connection after some content: the client has what was sent, then the
/// gateway's error event; the call is refunded with the reason.
async fn assert_a_stream_cut_mid_way_is_refunded(db: TestDb) {
    let provider = FakeProvider::start().await;
    let gateway = provider_gateway(&db, &[&provider], "").await;
    let key = db.funded_key(10, 0).await;

    provider.then(Fault::sse([MESSAGES_START, MESSAGES_DELTA]).ending(StreamEnd::Cut));
    let received = messages_stream(&gateway, &key).await;
    assert_eq!(received.status, 200);
    let expected_error = "event: error\ndata: {\"error\":{\"message\":\"上游服务暂时不可用\",\"type\":\"api_error\"},\"type\":\"error\"}\n\n";
    assert_eq!(
        received.text(),
        format!("{MESSAGES_START}{MESSAGES_DELTA}{expected_error}")
    );
    let entry = db.calls(&key).await.remove(0);
    assert_eq!(entry.status, CallStatus::Refunded);
    assert!(
        entry.upstream_error.as_deref().unwrap().contains("stream"),
        "{entry:?}"
    );

    provider.then(Fault::sse([CHAT_ROLE, CHAT_DELTA, "data: {\"choi"]).ending(StreamEnd::Cut));
    let received = stream(&gateway, CHAT, &key, chat_stream_body(CHAT_MODEL)).await;
    let last = received.data().pop().unwrap();
    assert_eq!(
        last["error"]["message"],
        "上游服务暂时不可用",
        "{}",
        received.text()
    );
    assert!(
        received
            .text()
            .starts_with(&format!("{CHAT_ROLE}{CHAT_DELTA}data: {{\"error\""))
    );
    assert_eq!(db.calls(&key).await[0].status, CallStatus::Refunded);

    assert_eq!(db.balance(&key).await, balance(10, 0));
    db.assert_audit_holds().await;
    db.drop_schema().await;
}

backends!(
    async fn a_stream_cut_mid_way_is_refunded(db) {
        assert_a_stream_cut_mid_way_is_refunded(db).await;
    }
);

/// The provider reports an error inside the stream: refunded, and the client gets the gateway's
/// error event instead of the provider's.
async fn assert_a_providers_error_event_is_refunded(db: TestDb) {
    let provider = FakeProvider::start().await;
    let gateway = provider_gateway(&db, &[&provider], "").await;
    let key = db.funded_key(10, 0).await;
    let overloaded = "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n";
    provider.then(Fault::sse([MESSAGES_START, MESSAGES_DELTA, overloaded]).ending(StreamEnd::Hang));
    let received = messages_stream(&gateway, &key).await;
    assert!(!received.text().contains("Overloaded"));
    let last = received.data().pop().unwrap();
    assert_eq!(last["error"]["type"], "api_error");
    let entry = db.calls(&key).await.remove(0);
    assert_eq!(entry.status, CallStatus::Refunded);
    assert!(
        entry
            .upstream_error
            .unwrap()
            .contains("overloaded_error: Overloaded")
    );

    let chat_error =
        "data: {\"error\":{\"message\":\"The server had an error\",\"type\":\"server_error\"}}\n\n";
    provider.then(Fault::sse([CHAT_ROLE, CHAT_DELTA, chat_error]));
    let received = stream(&gateway, CHAT, &key, chat_stream_body(CHAT_MODEL)).await;
    assert_eq!(
        received.data().pop().unwrap()["error"]["message"],
        "上游服务暂时不可用"
    );
    assert_eq!(db.calls(&key).await[0].status, CallStatus::Refunded);
    assert_eq!(db.balance(&key).await, balance(10, 0));
    db.assert_audit_holds().await;
    db.drop_schema().await;
}

backends!(
    async fn a_providers_error_event_is_refunded(db) {
        assert_a_providers_error_event_is_refunded(db).await;
    }
);

/// A client that leaves mid-stream: the provider's connection is dropped at once; billed if
/// content had reached the client, refunded otherwise.
async fn assert_a_client_that_leaves_is_billed_only_after_content(db: TestDb) {
    let provider = FakeProvider::start().await;
    let gateway = provider_gateway(&db, &[&provider], "").await;
    let key = db.funded_key(10, 0).await;

    // An empty block opening is not content yet.
    let empty_block = "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n";
    for (events, billed) in [
        (vec![MESSAGES_START], false),
        (vec![MESSAGES_START, empty_block], false),
        (vec![MESSAGES_START, MESSAGES_DELTA], true),
    ] {
        leave_after(
            &gateway,
            &provider,
            MESSAGES,
            &key,
            messages_stream_body(MESSAGES_MODEL),
            &events,
        )
        .await;
        let entry = finished_call(&db, &key).await;
        if billed {
            assert_eq!(entry.status, CallStatus::Ok);
            assert_eq!(entry.input_tokens, Some(10));
        } else {
            assert_eq!(entry.status, CallStatus::Refunded);
            assert_eq!(
                entry.upstream_error.as_deref(),
                Some(CLIENT_LEFT_BEFORE_CONTENT)
            );
        }
    }
    assert_eq!(db.balance(&key).await, balance(10 - MESSAGES_PRICE, 0));
    db.assert_audit_holds().await;
    db.drop_schema().await;
}

backends!(
    async fn a_client_that_leaves_is_billed_only_after_content(db) {
        assert_a_client_that_leaves_is_billed_only_after_content(db).await;
    }
);

#[tokio::test]
async fn a_stream_quiet_past_its_idle_time_out_is_refunded() {
    let (db, provider, gateway, key) = one_provider("stream_idle_timeout_secs = 1", 10).await;
    provider.then(Fault::sse([CHAT_ROLE, CHAT_DELTA]).ending(StreamEnd::Hang));
    let started = Instant::now();
    let received = stream(&gateway, CHAT, &key, chat_stream_body(CHAT_MODEL)).await;
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert_eq!(received.data().pop().unwrap()["error"]["type"], "api_error");
    let entry = db.calls(&key).await.remove(0);
    assert_eq!(entry.status, CallStatus::Refunded);
    assert!(entry.upstream_error.unwrap().contains("no event"));
    assert!(provider.wait_hung_up(1, Duration::from_secs(5)).await);
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

#[tokio::test]
async fn the_idle_time_out_counts_from_the_last_event_not_the_start() {
    let (db, provider, gateway, key) = one_provider("stream_idle_timeout_secs = 1", 10).await;
    // An event every 400 ms for 2.4 s: longer than the idle time-out, never quiet that long.
    let mut events = vec![CHAT_ROLE];
    events.extend(std::iter::repeat_n(CHAT_DELTA, 5));
    events.push("data: [DONE]\n\n");
    provider.then(Fault::sse(events).spaced(Duration::from_millis(400)));
    let started = Instant::now();
    let received = stream(&gateway, CHAT, &key, chat_stream_body(CHAT_MODEL)).await;
    assert!(started.elapsed() >= Duration::from_secs(2));
    assert_eq!(
        received.data().len(),
        6,
        "every event and [DONE], no error event"
    );
    let entry = db.calls(&key).await.remove(0);
    assert_eq!(entry.status, CallStatus::Ok, "{:?}", entry.upstream_error);
    assert_eq!(db.balance(&key).await, balance(10 - CHAT_PRICE, 0));
}

#[tokio::test]
async fn a_stream_past_its_deadline_is_refunded_however_busy() {
    let (db, provider, gateway, key) = one_provider("stream_deadline_secs = 1", 10).await;
    // An event every 200 ms for four seconds: never idle, but longer than the deadline.
    let mut events = vec![CHAT_ROLE];
    events.extend(std::iter::repeat_n(CHAT_DELTA, 20));
    provider.then(Fault::sse(events).spaced(Duration::from_millis(200)));
    let received = stream(&gateway, CHAT, &key, chat_stream_body(CHAT_MODEL)).await;
    assert_eq!(received.data().pop().unwrap()["error"]["type"], "api_error");
    let entry = db.calls(&key).await.remove(0);
    assert_eq!(entry.status, CallStatus::Refunded);
    assert!(entry.upstream_error.unwrap().contains("deadline"));
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

/// How a stream in the random test ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Finished,
    Cut,
    ErrorEvent,
    LeftAfterContent,
    LeftBeforeContent,
}

impl Ending {
    fn random() -> Ending {
        [
            Ending::Finished,
            Ending::Cut,
            Ending::ErrorEvent,
            Ending::LeftAfterContent,
            Ending::LeftBeforeContent,
        ][fastrand::usize(0..5)]
    }

    fn fault(self) -> Fault {
        let error = "data: {\"error\":{\"message\":\"x\"}}\n\n";
        match self {
            Ending::Finished => Fault::sse([CHAT_ROLE, CHAT_DELTA, "data: [DONE]\n\n"]),
            Ending::Cut => Fault::sse([CHAT_ROLE, CHAT_DELTA]).ending(StreamEnd::Cut),
            Ending::ErrorEvent => Fault::sse([CHAT_ROLE, CHAT_DELTA, error]),
            Ending::LeftAfterContent => Fault::sse([CHAT_ROLE, CHAT_DELTA]).ending(StreamEnd::Hang),
            Ending::LeftBeforeContent => Fault::sse([CHAT_ROLE]).ending(StreamEnd::Hang),
        }
    }

    fn billed(self) -> bool {
        matches!(self, Ending::Finished | Ending::LeftAfterContent)
    }

    /// Plays the client's part: reads to the end, or leaves after what it waits for.
    async fn play(self, response: reqwest::Response) {
        let wanted = match self {
            Ending::LeftAfterContent => CHAT_ROLE.len() + CHAT_DELTA.len(),
            Ending::LeftBeforeContent => CHAT_ROLE.len(),
            _ => {
                read_stream(response).await;
                return;
            }
        };
        let mut response = response;
        let mut received = 0;
        while received < wanted {
            received += response.chunk().await.unwrap().unwrap().len();
        }
    }
}

/// Many streams at once, each ending one of the ways a stream can end, chosen at random, each
/// on an account of its own: each entry ends exactly as its stream did, nothing stays pending,
/// and the books balance.
async fn assert_random_stream_endings_each_write_one_outcome(db: TestDb) {
    const STREAMS: usize = 40;
    let provider = FakeProvider::start().await;
    let gateway = std::sync::Arc::new(provider_gateway(&db, &[&provider], "").await);
    let mut streams = Vec::new();
    for i in 0..STREAMS {
        let ending = Ending::random();
        let request_id = format!("stream-{i}");
        provider.for_request_id(&request_id, ending.fault());
        streams.push((db.funded_key(CHAT_PRICE, 0).await, ending, request_id));
    }
    let tasks: Vec<_> = streams
        .iter()
        .cloned()
        .map(|(key, ending, request_id)| {
            let gateway = gateway.clone();
            tokio::spawn(async move {
                let response = gateway
                    .client
                    .post(format!("{}{CHAT}", gateway.base))
                    .bearer_auth(&key)
                    .header("x-request-id", request_id)
                    .json(&chat_stream_body(CHAT_MODEL))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(response.status(), 200, "{ending:?}");
                ending.play(response).await;
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    for (key, ending, _) in &streams {
        let entry = finished_call(&db, key).await;
        let expected = if ending.billed() {
            CallStatus::Ok
        } else {
            CallStatus::Refunded
        };
        assert_eq!(entry.status, expected, "{ending:?}: {entry:?}");
        let left = if ending.billed() { 0 } else { CHAT_PRICE };
        assert_eq!(db.balance(key).await, balance(left, 0), "{ending:?}");
        assert_eq!(db.calls(key).await.len(), 1);
    }
    db.assert_audit_holds().await;
    db.drop_schema().await;
}

backends!(
    #[multi_thread]
    async fn random_stream_endings_each_write_one_outcome(db) {
        assert_random_stream_endings_each_write_one_outcome(db).await;
    }
);

/// An event's start that never ends: `data: ` and 64 chunks of 64 KiB, no blank line.
fn endless_event() -> Vec<Vec<u8>> {
    let mut chunks = vec![b"data: {\"choices\":[{\"delta\":{\"content\":\"".to_vec()];
    chunks.extend(std::iter::repeat_n(vec![b'x'; 64 * 1024], 64));
    chunks
}

/// Finding 4 of the fault run: an event that never ends, after the stream started, is read no
/// further than the largest event: the stream fails at once (not at the idle time-out), is
/// refunded, and the client gets a final error event.
#[tokio::test]
async fn an_event_past_the_largest_event_ends_the_stream_refunded() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let settings = "max_event_bytes = 262144\nstream_idle_timeout_secs = 60";
    let gateway = provider_gateway(&db, &[&provider], settings).await;
    let key = db.funded_key(10, 0).await;
    let mut chunks = vec![CHAT_ROLE.as_bytes().to_vec()];
    chunks.extend(endless_event());
    provider.then(Fault::sse(chunks).ending(StreamEnd::Hang));
    let received = stream_refunded_for_size(&gateway, &db, &key).await;
    assert_eq!(received.data().pop().unwrap()["error"]["type"], "api_error");
}

/// Streams a chat call that must end at once (not at a time-out), refunded for an event past
/// 262144 bytes, the key's 10 credits all back.
async fn stream_refunded_for_size(gateway: &Gateway, db: &TestDb, key: &str) -> Streamed {
    let started = Instant::now();
    let received = stream(gateway, CHAT, key, chat_stream_body(CHAT_MODEL)).await;
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    let entry = finished_call(db, key).await;
    assert_eq!(entry.status, CallStatus::Refunded);
    assert!(entry.upstream_error.unwrap().contains("262144 bytes"));
    assert_eq!(db.balance(key).await, balance(10, 0));
    received
}

/// Finding 4: a first event that never ends is an upstream failure before the stream starts: a
/// JSON 502 and a refund, at once.
#[tokio::test]
async fn a_first_event_past_the_largest_event_is_a_refunded_502() {
    let (db, provider, gateway, key) = one_provider("max_event_bytes = 262144", 10).await;
    provider.then(Fault::sse(endless_event()).ending(StreamEnd::Hang));
    let received = stream_refunded_for_size(&gateway, &db, &key).await;
    assert_eq!(received.status, 502);
}

/// Finding 4: a complete reply larger than the largest reply, declared or not, fails the call
/// (502, refunded) instead of being buffered and billed.
#[tokio::test]
async fn a_reply_past_the_largest_reply_is_a_refunded_502() {
    let (db, provider, gateway, key) = one_provider("max_reply_bytes = 262144", 10).await;
    let big = format!("{{\"usage\":{{}},\"pad\":\"{}\"}}", "x".repeat(512 * 1024));
    provider.then(Fault::json(200, &big));
    let mut chunked = vec![b"{\"usage\":{},\"pad\":\"".to_vec()];
    chunked.extend(std::iter::repeat_n(vec![b'x'; 64 * 1024], 64));
    provider.then(Fault::sse(chunked).content_type("application/json"));
    for how in ["declared", "chunked"] {
        let answer = gateway.chat(&key, CHAT_MODEL).await;
        assert_eq!(answer.status, 502, "{how}");
    }
    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), 2);
    for call in calls {
        assert_eq!(call.status, CallStatus::Refunded);
        assert!(call.upstream_error.unwrap().contains("262144 bytes"));
    }
    assert_eq!(db.balance(&key).await, balance(10, 0));
    // Within the limit, a reply is read whole as before.
    provider.then(Fault::json(200, r#"{"usage":{}}"#));
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
}
