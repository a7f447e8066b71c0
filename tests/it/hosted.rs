//! Claude and Gemini where a cloud platform hosts them: Amazon Bedrock and Google Vertex AI
//! upstreams through the example gateway over real HTTP, against fakes that check what the real
//! platforms check (`common::fake_cloud`): each Bedrock request's Signature Version 4
//! recomputed, Bedrock's streams as event-stream frames with their CRCs, Vertex's access tokens
//! issued for a JWT that verifies and refused once expired. Billing, failover, refunds and
//! translation are those of any channel; credentials never reach a log, an error or the call
//! log.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common;
use crate::streaming::stream;

use common::fake_cloud::*;
use common::fake_provider::{FakeProvider, Fault, StreamEnd};
use common::*;
use model_gateway::store::CallStatus;
use model_gateway::upstream::HttpUpstream;
use model_gateway::{Catalogue, Upstream};
use serde_json::{Value, json};

const BEDROCK_MODEL_ID: &str = "anthropic.claude-sonnet-4-5-20250929-v1:0";
const VERTEX_CLAUDE_ID: &str = "claude-sonnet-4-5@20250929";
const PRICE: i64 = 3;

/// The fakes, and a directory for the service account's key file.
struct Cloud {
    bedrock: FakeBedrock,
    vertex: FakeVertex,
    anthropic: FakeProvider,
    dir: tempfile::TempDir,
}

impl Cloud {
    /// The fakes, Vertex's tokens living `lifetime`.
    async fn start(lifetime: Duration) -> Cloud {
        Cloud {
            bedrock: FakeBedrock::start().await,
            vertex: FakeVertex::start(lifetime).await,
            anthropic: FakeProvider::start().await,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    /// A streaming catalogue with an upstream on each fake, and these models:
    /// - `claude-bedrock`, `claude-vertex`, `gemini-vertex` (3 credits a call), each on one;
    /// - `claude-bedrock-tokens` and `claude-anthropic-tokens` (an input token 1 credit, an
    ///   output token 2, a cache read 0.1);
    /// - `claude-failover`: Anthropic, then Bedrock, then Vertex.
    fn catalogue(&self) -> Catalogue {
        let key_file = self.vertex.key_file(self.dir.path());
        let vertex = |name: &str, publisher: &str| {
            format!(
                "[[upstreams]]\nname = \"{name}\"\nkind = \"vertex\"\npublisher = \"{publisher}\"\n\
                 project = \"{VERTEX_PROJECT}\"\nregion = \"{VERTEX_REGION}\"\nbase_url = \"{}\"\n\
                 credentials_file = \"{}\"\n",
                self.vertex.base,
                key_file.display()
            )
        };
        let tokens = "max_output_tokens = 100\n[models.tokens]\ninput = 1000000\noutput = 2000000\ncache_read = 100000\n";
        let claude = |name: &str, channels: &str, price: &str| {
            format!(
                "[[models]]\nname = \"{name}\"\nprotocol = \"messages\"\n\
                 endpoints = [\"messages\", \"chat_completions\", \"responses\"]\n\
                 upstreams = [{channels}]\n{price}"
            )
        };
        let bedrock_channel =
            format!("{{ name = \"bedrock\", upstream_model = \"{BEDROCK_MODEL_ID}\" }}");
        let vertex_channel =
            format!("{{ name = \"vertex-claude\", upstream_model = \"{VERTEX_CLAUDE_ID}\" }}");
        let price = format!("price = {PRICE}\n");
        Catalogue::from_toml(&format!(
            "streaming = true\n\
             [[upstreams]]\nname = \"bedrock\"\nkind = \"bedrock\"\nregion = \"{REGION}\"\nbase_url = \"{}\"\n\
             {}{}\
             [[upstreams]]\nname = \"anthropic\"\nkind = \"anthropic\"\nbase_url = \"{}\"\napi_key_env = \"K\"\n\
             {}{}{}{}{}\
             [[models]]\nname = \"gemini-vertex\"\nprotocol = \"gemini\"\nprice = {PRICE}\n\
             upstreams = [{{ name = \"vertex-gemini\", upstream_model = \"gemini-2.5-flash\" }}]\n",
            self.bedrock.base,
            vertex("vertex-claude", "anthropic"),
            vertex("vertex-gemini", "google"),
            self.anthropic.base,
            claude("claude-bedrock", &bedrock_channel, &price),
            claude("claude-vertex", &vertex_channel, &price),
            claude("claude-bedrock-tokens", &bedrock_channel, tokens),
            claude("claude-anthropic-tokens", "{ name = \"anthropic\" }", tokens),
            claude(
                "claude-failover",
                &format!(
                    "{{ name = \"anthropic\", priority = 0 }}, \
                     {{ name = \"bedrock\", upstream_model = \"{BEDROCK_MODEL_ID}\", priority = 1 }}, \
                     {{ name = \"vertex-claude\", upstream_model = \"{VERTEX_CLAUDE_ID}\", priority = 2 }}"
                ),
                &price
            ),
        ))
        .unwrap()
    }

    /// The gateway in front of the fakes, its provider keys read from `keys`.
    async fn gateway(
        &self,
        db: &TestDb,
        keys: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
    ) -> Gateway {
        gateway_on(db, self.catalogue(), keys).await
    }
}

fn messages(model: &str) -> String {
    messages_body(model)
}

fn streamed_messages(model: &str) -> Value {
    json!({
        "model": model, "max_tokens": 64, "stream": true,
        "messages": [{ "role": "user", "content": "Hello" }]
    })
}

/// The events a client read, by their `type`.
fn kinds(data: &[Value]) -> Vec<&str> {
    data.iter()
        .filter_map(|event| event["type"].as_str())
        .collect()
}

/// The fakes (tokens living an hour), a database, the gateway in front of the fakes with the
/// test credentials, and a key funded with `credits`.
async fn started(credits: i64) -> (Cloud, TestDb, Gateway, String) {
    let cloud = Cloud::start(Duration::from_secs(3600)).await;
    let db = local_db().await;
    let gateway = cloud.gateway(&db, cloud_keys).await;
    let key = db.funded_key(credits, 0).await;
    (cloud, db, gateway, key)
}

/// The gateway calling the upstreams of `catalogue`, its provider keys read from `keys`.
async fn gateway_on(
    db: &TestDb,
    catalogue: Catalogue,
    keys: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
) -> Gateway {
    let upstream = HttpUpstream::with_keys(&catalogue, keys).unwrap();
    start_gateway(
        db,
        catalogue,
        Upstream::Http(upstream),
        model_gateway::router::DEFAULT_MAX_BODY_BYTES,
    )
    .await
}

/// `key`'s last call was refunded (its balance `credits` again), the operator told why in
/// words holding each of `says`.
async fn assert_refunded(db: &TestDb, key: &str, credits: i64, says: &[&str]) {
    let entry = db.calls(key).await.remove(0);
    assert_eq!(entry.status, CallStatus::Refunded, "{entry:?}");
    let error = entry.upstream_error.unwrap_or_default();
    for words in says {
        let (error, words) = (error.to_lowercase(), words.to_lowercase());
        assert!(error.contains(&words), "{words}: {error}");
    }
    assert_eq!(db.balance(key).await, balance(credits, 0));
}

// --- Bedrock ----------------------------------------------------------------------------------

#[tokio::test]
async fn a_bedrock_call_is_signed_and_sent_as_bedrock_takes_anthropics_body() {
    let (cloud, db, gateway, key) = started(10).await;

    let answer = gateway
        .send(
            gateway
                .client
                .post(format!("{}{MESSAGES}", gateway.base))
                .header("x-api-key", &key)
                .header("anthropic-beta", "context-1m-2025-08-07")
                .header("content-type", "application/json")
                .body(messages("claude-bedrock")),
        )
        .await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(answer.body["content"][0]["text"], "Hello from the cloud.");

    assert_eq!(cloud.bedrock.refused(), 0, "the signature verified");
    let call = cloud.bedrock.calls().remove(0);
    assert_eq!(
        call.path,
        "/model/anthropic.claude-sonnet-4-5-20250929-v1%3A0/invoke"
    );
    assert_eq!(call.body["anthropic_version"], "bedrock-2023-05-31");
    assert_eq!(
        call.body["anthropic_beta"],
        json!(["context-1m-2025-08-07"])
    );
    assert!(call.body.get("model").is_none());
    assert!(call.headers.get("x-api-key").is_none());

    let entry = db.calls(&key).await.remove(0);
    assert_eq!(entry.status, CallStatus::Ok);
    assert_eq!(entry.channel.as_deref(), Some("bedrock"));
    assert_eq!(db.balance(&key).await, balance(10 - PRICE, 0));
}

#[tokio::test]
async fn a_request_signed_with_the_wrong_secret_is_refused_by_bedrock_and_fails_the_channel_not_the_client()
 {
    let cloud = Cloud::start(Duration::from_secs(3600)).await;
    let db = local_db().await;
    let gateway = cloud
        .gateway(&db, |variable| match variable {
            "AWS_SECRET_ACCESS_KEY" => Some("not-the-secret".into()),
            other => cloud_keys(other),
        })
        .await;
    let key = db.funded_key(10, 0).await;

    let answer = gateway.messages(&key, "claude-bedrock").await;
    assert_eq!(answer.status, 502);
    assert_eq!(answer.detail(), "上游服务暂时不可用");
    assert_eq!(cloud.bedrock.refused(), 1);
    assert!(cloud.bedrock.calls().is_empty());
    assert_refunded(
        &db,
        &key,
        10,
        &[
            "refused this upstream's credentials",
            "signature we calculated does not match",
        ],
    )
    .await;
}

#[tokio::test]
async fn a_bedrock_api_key_is_sent_as_a_bearer_token_instead_of_a_signature() {
    let cloud = Cloud::start(Duration::from_secs(3600)).await;
    let db = local_db().await;
    let gateway = cloud
        .gateway(&db, |variable| match variable {
            "AWS_BEARER_TOKEN_BEDROCK" => Some(BEDROCK_API_KEY.into()),
            // No AWS keys at all: the API key alone serves.
            "AWS_ACCESS_KEY_ID" | "AWS_SECRET_ACCESS_KEY" => None,
            other => cloud_keys(other),
        })
        .await;
    let key = db.funded_key(10, 0).await;

    let answer = gateway.messages(&key, "claude-bedrock").await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let call = cloud.bedrock.calls().remove(0);
    assert_eq!(
        call.headers.get("authorization").unwrap(),
        &format!("Bearer {BEDROCK_API_KEY}")
    );
    assert!(call.headers.get("x-amz-date").is_none());
}

#[tokio::test]
async fn a_bedrock_without_credentials_fails_without_being_contacted() {
    let cloud = Cloud::start(Duration::from_secs(3600)).await;
    let db = local_db().await;
    let gateway = cloud
        .gateway(&db, |variable| {
            (!variable.starts_with("AWS_")).then(|| "sk-provider".into())
        })
        .await;
    let key = db.funded_key(10, 0).await;

    let answer = gateway.messages(&key, "claude-bedrock").await;
    assert_eq!(answer.status, 502);
    assert_eq!(cloud.bedrock.refused() + cloud.bedrock.calls().len(), 0);
    let error = db.calls(&key).await.remove(0).upstream_error.unwrap();
    assert!(error.contains("no Bedrock credentials"), "{error}");
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

#[tokio::test]
async fn a_bedrock_stream_reaches_the_client_as_anthropics_events_and_is_billed_by_bedrocks_count()
{
    let (cloud, db, gateway, key) = started(100_000).await;

    // The output count is Bedrock's alone: the events report none.
    let mut events = anthropic_events(10, 0);
    events[5]["usage"] = json!({});
    events[6]["amazon-bedrock-invocationMetrics"] = json!({
        "inputTokenCount": 10, "outputTokenCount": 7,
        "invocationLatency": 420, "firstByteLatency": 200,
    });
    cloud
        .bedrock
        .then(CloudReply::Events(events, Ending::Finish));
    let received = stream(
        &gateway,
        MESSAGES,
        &key,
        streamed_messages("claude-bedrock-tokens"),
    )
    .await;
    assert_eq!(received.status, 200);
    assert_eq!(received.content_type(), "text/event-stream");
    assert!(
        received.text().starts_with("event: message_start\ndata: {"),
        "{}",
        received.text()
    );
    let data = received.data();
    assert_eq!(
        kinds(&data),
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let call = cloud.bedrock.calls().remove(0);
    assert!(call.path.ends_with("/invoke-with-response-stream"));

    let entry = db.calls(&key).await.remove(0);
    assert_eq!(entry.status, CallStatus::Ok);
    assert_eq!(
        (entry.input_tokens, entry.output_tokens),
        (Some(10), Some(7))
    );
    assert_eq!(db.balance(&key).await, balance(100_000 - (10 + 2 * 7), 0));
}

#[tokio::test]
async fn cache_reads_and_writes_are_priced_as_bedrock_reports_them() {
    let (cloud, db, gateway, key) = started(100_000).await;

    let mut reply = anthropic_message("cached", 10, 5);
    reply["usage"]["cache_read_input_tokens"] = json!(100);
    reply["usage"]["cache_creation_input_tokens"] = json!(20);
    cloud.bedrock.then(CloudReply::Json(reply));
    let answer = gateway.messages(&key, "claude-bedrock-tokens").await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let entry = db.calls(&key).await.remove(0);
    assert_eq!(
        (entry.cache_read_tokens, entry.cache_write_tokens),
        (Some(100), Some(20))
    );
    // 10 input and 20 written at 1 (no cache-write price: input's), 100 read at 0.1, 5 out at 2.
    assert_eq!(
        db.balance(&key).await,
        balance(100_000 - (10 + 20 + 10 + 10), 0)
    );
}

#[tokio::test]
async fn a_frame_whose_checksum_is_wrong_fails_the_channel() {
    let db = local_db().await;
    let key = db.funded_key(10, 0).await;
    // A frame's payload changed after its CRC was written, from a provider that otherwise
    // answers as Bedrock does.
    let mut frame = chunk_frame(&anthropic_events(1, 1)[0]);
    let middle = frame.len() / 2;
    frame[middle] ^= 0x20;
    let provider = FakeProvider::start().await;
    provider.then(Fault::sse([frame]).content_type("application/vnd.amazon.eventstream"));
    let catalogue = Catalogue::from_toml(&format!(
        "streaming = true\n[[upstreams]]\nname = \"bedrock\"\nkind = \"bedrock\"\nregion = \"{REGION}\"\nbase_url = \"{}\"\n\
         [[models]]\nname = \"claude\"\nprotocol = \"messages\"\nprice = 3\nupstream = \"bedrock\"\n",
        provider.base
    ))
    .unwrap();
    let gateway = gateway_on(&db, catalogue, cloud_keys).await;
    let received = stream(&gateway, MESSAGES, &key, streamed_messages("claude")).await;
    assert_eq!(received.status, 502, "{}", received.text());
    assert_refunded(&db, &key, 10, &["does not decode", "checksum"]).await;
}

#[tokio::test]
async fn bedrock_throttling_and_vertex_resource_exhausted_fail_over_to_the_next_channel() {
    let (cloud, db, gateway, key) = started(100).await;
    cloud.anthropic.always(Fault::json(
        529,
        r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
    ));

    // Anthropic overloaded, Bedrock throttled: Vertex serves.
    cloud.bedrock.then(CloudReply::Error(
        429,
        vec![(
            "x-amzn-errortype",
            "ThrottlingException:http://internal.amazon.com/coral/com.amazon.bedrock/",
        )],
        json!({"message": "Too many requests, please wait before trying again."}),
    ));
    let answer = gateway.messages(&key, "claude-failover").await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(cloud.vertex.calls().len(), 1);
    let entry = db.calls(&key).await.remove(0);
    assert_eq!(entry.channel.as_deref(), Some("vertex-claude"));

    // Bedrock's exception before any event of a stream is its failure too: Vertex serves.
    cloud.bedrock.then(CloudReply::Exception(
        vec![],
        "throttlingException",
        "Too many tokens, please wait before trying again.",
    ));
    cloud
        .vertex
        .then(CloudReply::Events(anthropic_events(5, 3), Ending::Finish));
    let received = stream(
        &gateway,
        MESSAGES,
        &key,
        streamed_messages("claude-failover"),
    )
    .await;
    assert_eq!(received.status, 200, "{}", received.text());
    assert_eq!(kinds(&received.data()).last(), Some(&"message_stop"));
    assert_eq!(
        db.calls(&key).await[0].channel.as_deref(),
        Some("vertex-claude")
    );

    // Vertex out of quota too: nothing serves, refunded.
    cloud.bedrock.then(CloudReply::Error(
        503,
        vec![],
        json!({"message": "ServiceUnavailableException"}),
    ));
    cloud.vertex.then(CloudReply::Error(
        429,
        vec![],
        json!({"error": {"code": 429, "message": "Quota exceeded", "status": "RESOURCE_EXHAUSTED"}}),
    ));
    let answer = gateway.messages(&key, "claude-failover").await;
    assert_eq!(answer.status, 502);
    assert_refunded(&db, &key, 100 - 2 * PRICE, &["RESOURCE_EXHAUSTED", "503"]).await;
}

#[tokio::test]
async fn a_failing_anthropic_channel_fails_over_to_bedrock_and_the_call_is_charged_once() {
    let (cloud, db, gateway, key) = started(10).await;
    cloud
        .anthropic
        .then(Fault::json(500, r#"{"error":"boom"}"#));

    let answer = gateway.messages(&key, "claude-failover").await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(cloud.anthropic.requests(), 1);
    assert_eq!(cloud.bedrock.calls().len(), 1);
    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].channel.as_deref(), Some("bedrock"));
    assert_eq!(db.balance(&key).await, balance(10 - PRICE, 0));
}

/// The same stream cut at the same place costs the same through Anthropic's own API and
/// through Bedrock: refunded at a price per call, the forwarded output billed at token prices;
/// and an exception frame mid-stream is a cut.
async fn assert_a_cut_bedrock_stream_is_billed_as_a_cut_anthropic_stream(db: &TestDb) {
    let cloud = Cloud::start(Duration::from_secs(3600)).await;
    let gateway = cloud.gateway(db, cloud_keys).await;
    // The events report 10 input tokens and no output.
    let events = anthropic_events(10, 0);
    let first_four = &events[..4];
    let sse: Vec<String> = first_four
        .iter()
        .map(|event| {
            format!(
                "event: {}\ndata: {event}\n\n",
                event["type"].as_str().unwrap()
            )
        })
        .collect();

    let whole: Vec<String> = events
        .iter()
        .map(|event| {
            format!(
                "event: {}\ndata: {event}\n\n",
                event["type"].as_str().unwrap()
            )
        })
        .collect();
    let mut outcomes = Vec::new();
    for (model, on_bedrock, cut) in [
        ("claude-anthropic-tokens", false, true),
        ("claude-bedrock-tokens", true, true),
        ("claude-anthropic-tokens", false, false),
        ("claude-bedrock-tokens", true, false),
    ] {
        let key = db.funded_key(100_000, 0).await;
        match (on_bedrock, cut) {
            (true, true) => {
                cloud
                    .bedrock
                    .then(CloudReply::Events(first_four.to_vec(), Ending::Cut));
            }
            (true, false) => {
                cloud
                    .bedrock
                    .then(CloudReply::Events(events.clone(), Ending::Finish));
            }
            (false, true) => {
                cloud
                    .anthropic
                    .then(Fault::sse(sse.clone()).ending(StreamEnd::Cut));
            }
            (false, false) => {
                cloud.anthropic.then(Fault::sse(whole.clone()));
            }
        }
        let received = stream(&gateway, MESSAGES, &key, streamed_messages(model)).await;
        assert_eq!(received.status, 200);
        let last = if cut { "error" } else { "message_stop" };
        assert_eq!(kinds(&received.data()).last(), Some(&last));
        let entry = db.calls(&key).await.remove(0);
        outcomes.push((
            entry.status,
            entry.input_tokens,
            entry.output_tokens,
            db.balance(&key).await,
        ));
    }
    assert_eq!(outcomes[0], outcomes[1], "cut: Anthropic, then Bedrock");
    assert_eq!(outcomes[0].0, CallStatus::Refunded, "{outcomes:?}");
    assert_eq!(
        outcomes[2], outcomes[3],
        "finished: Anthropic, then Bedrock"
    );
    assert_eq!(
        outcomes[2],
        (CallStatus::Ok, Some(10), Some(0), balance(100_000 - 10, 0)),
        "billed what the events report"
    );

    // At a price per call: refunded, and an exception frame mid-stream is a cut too.
    for reply in [
        CloudReply::Events(first_four.to_vec(), Ending::Cut),
        CloudReply::Exception(
            first_four.to_vec(),
            "modelStreamErrorException",
            "The model stopped.",
        ),
    ] {
        let key = db.funded_key(10, 0).await;
        cloud.bedrock.then(reply);
        let received = stream(
            &gateway,
            MESSAGES,
            &key,
            streamed_messages("claude-bedrock"),
        )
        .await;
        assert_eq!(kinds(&received.data()).last(), Some(&"error"));
        let entry = db.calls(&key).await.remove(0);
        assert_eq!(entry.status, CallStatus::Refunded, "{entry:?}");
        assert_eq!(db.balance(&key).await, balance(10, 0));
    }
    db.assert_audit_holds().await;
}

backends!(
    async fn a_cut_bedrock_stream_is_billed_as_a_cut_anthropic_stream(db) {
        assert_a_cut_bedrock_stream_is_billed_as_a_cut_anthropic_stream(&db).await;
        db.drop_schema().await;
    }
);

// --- Vertex AI --------------------------------------------------------------------------------

#[tokio::test]
async fn vertex_calls_share_one_token_and_renew_it_before_it_expires() {
    // Tokens live 2 s: renewed after 1 s.
    let cloud = Cloud::start(Duration::from_secs(2)).await;
    let db = local_db().await;
    let gateway = cloud.gateway(&db, cloud_keys).await;
    let key = db.funded_key(100, 0).await;

    for _ in 0..3 {
        let answer = gateway.messages(&key, "claude-vertex").await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
    }
    assert_eq!(
        cloud.vertex.tokens_issued().len(),
        1,
        "one token for three calls"
    );
    let call = cloud.vertex.calls().remove(0);
    assert_eq!(
        call.path,
        format!(
            "/v1/projects/{VERTEX_PROJECT}/locations/{VERTEX_REGION}/publishers/anthropic/models/{VERTEX_CLAUDE_ID}:rawPredict"
        )
    );
    assert_eq!(call.body["anthropic_version"], "vertex-2023-10-16");

    tokio::time::sleep(Duration::from_millis(1300)).await;
    let answer = gateway.messages(&key, "claude-vertex").await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let issued = cloud.vertex.tokens_issued();
    assert_eq!(issued.len(), 2, "renewed before it expired");
    let last = cloud.vertex.calls().pop().unwrap();
    assert_eq!(
        last.headers.get("authorization").unwrap(),
        &format!("Bearer {}", issued[1])
    );
    assert_eq!(cloud.vertex.refused(), 0);
    assert_eq!(cloud.vertex.token_requests_refused(), 0);

    // The fake refuses a token past its life, as Google does.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let refused = reqwest::Client::new()
        .post(format!("{}{}", cloud.vertex.base, call.path))
        .bearer_auth(&issued[0])
        .json(&json!({"anthropic_version": "vertex-2023-10-16", "max_tokens": 5, "messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
}

#[tokio::test]
async fn a_token_vertex_refuses_fails_the_channel_and_the_next_call_fetches_another() {
    let (cloud, db, gateway, key) = started(100).await;

    assert_eq!(gateway.messages(&key, "claude-vertex").await.status, 200);
    cloud.vertex.expire_tokens();
    let answer = gateway.messages(&key, "claude-vertex").await;
    assert_eq!(answer.status, 502);
    assert_eq!(answer.detail(), "上游服务暂时不可用");
    let says = ["refused this upstream's credentials", "UNAUTHENTICATED"];
    assert_refunded(&db, &key, 100 - PRICE, &says).await;

    assert_eq!(gateway.messages(&key, "claude-vertex").await.status, 200);
    assert_eq!(cloud.vertex.tokens_issued().len(), 2);
    assert_eq!(db.balance(&key).await, balance(100 - 2 * PRICE, 0));
}

#[tokio::test]
async fn a_service_account_whose_key_is_not_its_own_gets_no_token_and_the_channel_fails() {
    let cloud = Cloud::start(Duration::from_secs(3600)).await;
    let db = local_db().await;
    // Another RSA key in the account's file: its JWT does not verify.
    let catalogue = cloud.catalogue();
    let path = cloud.dir.path().join("service-account.json");
    let mut file: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    file["private_key"] = include_str!("../fixtures/vertex-other-key.pem").into();
    std::fs::write(&path, file.to_string()).unwrap();
    let gateway = gateway_on(&db, catalogue, cloud_keys).await;
    let key = db.funded_key(10, 0).await;

    let answer = gateway.messages(&key, "claude-vertex").await;
    assert_eq!(answer.status, 502);
    assert_eq!(cloud.vertex.token_requests_refused(), 1);
    assert!(cloud.vertex.calls().is_empty());
    let error = db.calls(&key).await.remove(0).upstream_error.unwrap();
    assert!(
        error.contains("could not get a Vertex access token"),
        "{error}"
    );
    assert!(error.contains("Invalid JWT Signature"), "{error}");
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

#[tokio::test]
async fn gemini_on_vertex_goes_to_googles_publisher_and_is_billed_by_its_usage() {
    let (cloud, db, gateway, key) = started(100).await;
    let reply = json!({
        "candidates": [{"content": {"parts": [{"text": "Hi"}], "role": "model"},
            "finishReason": "STOP", "index": 0}],
        "usageMetadata": {"promptTokenCount": 4, "candidatesTokenCount": 2, "totalTokenCount": 6},
    });
    cloud.vertex.then(CloudReply::Json(reply.clone()));
    let body = json!({"contents": [{"role": "user", "parts": [{"text": "Hello"}]}]});
    let answer = gateway
        .post_bearer(
            "/v1beta/models/gemini-vertex:generateContent",
            &key,
            body.to_string(),
        )
        .await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(answer.body, reply);
    let call = cloud.vertex.calls().remove(0);
    assert!(
        call.path
            .ends_with("/publishers/google/models/gemini-2.5-flash:generateContent"),
        "{}",
        call.path
    );
    assert_eq!(call.body, body);

    cloud
        .vertex
        .then(CloudReply::Events(vec![reply], Ending::Finish));
    let received = stream(
        &gateway,
        "/v1beta/models/gemini-vertex:streamGenerateContent?alt=sse",
        &key,
        body,
    )
    .await;
    assert_eq!(received.status, 200, "{}", received.text());
    assert_eq!(received.data()[0]["candidates"][0]["finishReason"], "STOP");
    let calls = db.calls(&key).await;
    assert!(calls.iter().all(|call| call.status == CallStatus::Ok));
    assert_eq!(db.balance(&key).await, balance(100 - 2 * PRICE, 0));
}

#[tokio::test]
async fn chat_and_responses_clients_reach_claude_on_bedrock_and_vertex_through_translation() {
    let (cloud, db, gateway, key) = started(100).await;

    for model in ["claude-bedrock", "claude-vertex"] {
        let answer = gateway.chat(&key, model).await;
        assert_eq!(answer.status, 200, "{model}: {:?}", answer.body);
        assert_eq!(
            answer.body["choices"][0]["message"]["content"],
            "Hello from the cloud."
        );
        let body = json!({"model": model, "input": "Hello"});
        let answer = gateway
            .post_bearer("/v1/responses", &key, body.to_string())
            .await;
        assert_eq!(answer.status, 200, "{model}: {:?}", answer.body);
        assert_eq!(
            answer.body["output"][0]["content"][0]["text"],
            "Hello from the cloud."
        );
    }
    // Streamed chat through Bedrock's frames.
    cloud
        .bedrock
        .then(CloudReply::Events(anthropic_events(5, 3), Ending::Finish));
    let body = json!({"model": "claude-bedrock", "stream": true,
        "messages": [{"role": "user", "content": "Hello"}]});
    let received = stream(&gateway, CHAT, &key, body).await;
    assert_eq!(received.status, 200, "{}", received.text());
    let text: String = received
        .data()
        .iter()
        .filter_map(|chunk| {
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(text, "Hello from the cloud.");
    assert!(received.text().ends_with("data: [DONE]\n\n"));
    for call in cloud.bedrock.calls() {
        assert_eq!(call.body["anthropic_version"], "bedrock-2023-05-31");
    }
    assert_eq!(db.balance(&key).await, balance(100 - 5 * PRICE, 0));
}

// --- Credentials --------------------------------------------------------------------------------

/// A log writer that keeps what the gateway logs.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn no_credential_reaches_a_log_an_error_body_or_the_call_log() {
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .finish();
    let _logging = tracing::subscriber::set_default(subscriber);

    let (cloud, db, gateway, key) = started(1000).await;
    let mut bodies = Vec::new();

    // Good calls, plain and streamed, on both platforms.
    let events = || CloudReply::Events(anthropic_events(5, 3), Ending::Finish);
    bodies.push(
        gateway
            .messages(&key, "claude-bedrock")
            .await
            .bytes
            .to_vec(),
    );
    cloud.bedrock.then(events());
    bodies.push(
        stream(
            &gateway,
            MESSAGES,
            &key,
            streamed_messages("claude-bedrock"),
        )
        .await
        .bytes(),
    );
    bodies.push(gateway.messages(&key, "claude-vertex").await.bytes.to_vec());
    cloud.vertex.then(events());
    bodies.push(
        stream(&gateway, MESSAGES, &key, streamed_messages("claude-vertex"))
            .await
            .bytes(),
    );
    // Platforms that echo the credentials they were sent back in their errors.
    let token = cloud.vertex.tokens_issued().remove(0);
    let aws = format!("you sent {AWS_ACCESS_KEY_ID} {AWS_SECRET_ACCESS_KEY} {AWS_SESSION_TOKEN}");
    let google = format!(
        "you sent {token} from {}",
        VERTEX_PRIVATE_KEY.replace('\n', "\\n")
    );
    for status in [400, 500] {
        let body = json!({ "message": aws });
        cloud.bedrock.then(CloudReply::Error(status, vec![], body));
        bodies.push(
            gateway
                .messages(&key, "claude-bedrock")
                .await
                .bytes
                .to_vec(),
        );
        let body = json!({"error": {"code": status, "message": google, "status": "INTERNAL"}});
        cloud.vertex.then(CloudReply::Error(status, vec![], body));
        bodies.push(gateway.messages(&key, "claude-vertex").await.bytes.to_vec());
    }
    // Credentials refused: a bad signature, an expired token.
    cloud.vertex.expire_tokens();
    bodies.push(gateway.messages(&key, "claude-vertex").await.bytes.to_vec());
    let wrong = cloud
        .gateway(&db, |variable| match variable {
            "AWS_SECRET_ACCESS_KEY" => Some("wrong-secret-also-secret".into()),
            other => cloud_keys(other),
        })
        .await;
    bodies.push(wrong.messages(&key, "claude-bedrock").await.bytes.to_vec());
    assert!(db.calls(&key).await.len() >= 10);

    let mut tokens = cloud.vertex.tokens_issued();
    assert!(!tokens.is_empty());
    tokens.extend([
        AWS_SECRET_ACCESS_KEY.to_owned(),
        AWS_SESSION_TOKEN.to_owned(),
        "wrong-secret-also-secret".to_owned(),
    ]);
    // Every line of the private key.
    let key_lines = VERTEX_PRIVATE_KEY
        .lines()
        .filter(|line| !line.starts_with("-----"));
    tokens.extend(key_lines.map(str::to_owned));
    let logged = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(
        logged.contains("could not") || logged.contains("refused"),
        "the failures were logged"
    );
    let recorded = format!("{:?}", db.calls(&key).await);
    for secret in &tokens {
        let line = logged.lines().find(|line| line.contains(secret.as_str()));
        assert!(line.is_none(), "the log holds {secret}: {line:?}");
        assert!(
            !recorded.contains(secret.as_str()),
            "the call log holds {secret}"
        );
        for body in &bodies {
            let body = String::from_utf8_lossy(body);
            assert!(
                !body.contains(secret.as_str()),
                "an answer holds {secret}: {body}"
            );
        }
    }
}
