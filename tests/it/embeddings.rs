//! `POST /v1/embeddings` over real HTTP: the mock's deterministic vectors, the provider's reply
//! byte for byte, the model's price per call, refunds and failover, and the endpoint's own
//! models only.

use crate::common;

use base64::Engine;
use common::fake_provider::{FakeProvider, Fault};
use common::*;
use model_gateway::{Catalogue, Protocol, store::CallStatus, upstream::MOCK_EMBEDDING_DIMENSIONS};
use serde_json::{Value, json};

const EMBEDDINGS: &str = "/v1/embeddings";
const EMBEDDING_MODEL: &str = "text-embedding-3-small";
const EMBEDDING_PRICE: i64 = 1;

fn floats(value: &Value) -> Vec<f64> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

#[tokio::test]
async fn an_embeddings_call_gets_the_request_id_idempotency_and_key_rules_of_every_call() {
    let body = json!({ "model": EMBEDDING_MODEL, "input": "a cat" });
    assert_the_rules_of_every_call(EMBEDDINGS, &body, EMBEDDING_PRICE).await;
}

#[tokio::test]
async fn a_mock_embeddings_call_gives_one_unit_vector_per_input_and_is_charged_its_price() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let body = json!({ "model": EMBEDDING_MODEL, "input": ["a cat", "a dog", "a cat"] });
    let answer = gateway
        .post_bearer(EMBEDDINGS, &key, body.to_string())
        .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.body["object"], "list");
    assert_eq!(answer.body["model"], EMBEDDING_MODEL);
    let data = answer.body["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    let vectors: Vec<Vec<f64>> = data.iter().map(|item| floats(&item["embedding"])).collect();
    for (index, (item, vector)) in data.iter().zip(&vectors).enumerate() {
        assert_eq!(
            (item["object"].as_str(), item["index"].as_u64()),
            (Some("embedding"), Some(index as u64))
        );
        assert_eq!(vector.len(), MOCK_EMBEDDING_DIMENSIONS);
        let norm: f64 = vector.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "{norm}");
    }
    assert_eq!(vectors[0], vectors[2], "the same input, the same vector");
    assert_ne!(vectors[0], vectors[1]);
    assert!(answer.body["usage"]["prompt_tokens"].as_u64().unwrap() > 0);

    assert_eq!(db.balance(&key).await, balance(10 - EMBEDDING_PRICE, 0));
    let [call] = db.calls(&key).await.try_into().unwrap();
    assert_eq!(
        (call.protocol, call.model.as_str()),
        (Protocol::Embeddings, EMBEDDING_MODEL)
    );
    assert_eq!(call.status, CallStatus::Ok);
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn mock_embeddings_honour_dimensions_and_base64_as_the_sdks_ask() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let ask = |format: &str| {
        json!({ "model": EMBEDDING_MODEL, "input": "hello", "dimensions": 8, "encoding_format": format })
            .to_string()
    };
    let as_floats = gateway.post_bearer(EMBEDDINGS, &key, ask("float")).await;
    let as_base64 = gateway.post_bearer(EMBEDDINGS, &key, ask("base64")).await;
    let vector = floats(&as_floats.body["data"][0]["embedding"]);
    assert_eq!(vector.len(), 8);
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(as_base64.body["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let decoded: Vec<f64> = bytes
        .chunks_exact(4)
        .map(|b| f64::from(f32::from_le_bytes(b.try_into().unwrap())))
        .collect();
    assert_eq!(decoded.len(), 8);
    for (a, b) in vector.iter().zip(&decoded) {
        assert!((a - b).abs() < 1e-6, "{a} {b}");
    }
    // A token array is one input; an array of token arrays is one per array.
    let tokens = json!({ "model": EMBEDDING_MODEL, "input": [[1, 2, 3], [4, 5]] }).to_string();
    let answer = gateway.post_bearer(EMBEDDINGS, &key, tokens).await;
    assert_eq!(answer.body["data"].as_array().unwrap().len(), 2);
    assert_eq!(answer.body["usage"]["prompt_tokens"], 5);
    assert_eq!(db.balance(&key).await, balance(10 - 3 * EMBEDDING_PRICE, 0));
}

#[tokio::test]
async fn embeddings_and_chat_models_are_not_found_on_each_others_endpoints() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let chat_here = json!({ "model": CHAT_MODEL, "input": "x" }).to_string();
    let embeddings_for_chat = chat_body(EMBEDDING_MODEL);
    let embeddings_for_messages = messages_body(EMBEDDING_MODEL);
    for (path, body) in [
        (EMBEDDINGS, chat_here),
        (CHAT, embeddings_for_chat),
        (MESSAGES, embeddings_for_messages),
    ] {
        let answer = gateway.post_bearer(path, &key, body).await;
        assert_eq!(
            (answer.status, answer.detail()),
            (404, "模型不存在"),
            "{path}"
        );
    }
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

#[tokio::test]
async fn an_embeddings_request_without_a_usable_input_is_400_and_uncharged() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    for body in [
        json!({ "model": EMBEDDING_MODEL }),
        json!({ "model": EMBEDDING_MODEL, "input": 5 }),
        json!({ "model": EMBEDDING_MODEL, "input": null }),
        json!({ "input": "x" }),
    ] {
        let answer = gateway
            .post_bearer(EMBEDDINGS, &key, body.to_string())
            .await;
        assert_eq!(answer.status, 400, "{body}");
        assert!(!answer.detail().is_empty());
    }
    assert_eq!(db.balance(&key).await, balance(10, 0));
    assert!(db.calls(&key).await.is_empty());
}

/// The embeddings model on the fake providers, as channels in this order.
fn embeddings_catalogue(providers: &[&FakeProvider]) -> Catalogue {
    let mut toml = String::new();
    let mut names = Vec::new();
    for (n, provider) in providers.iter().enumerate() {
        toml.push_str(&format!(
            "[[upstreams]]\nname = \"p{n}\"\nkind = \"openai\"\nbase_url = \"{}/v1\"\napi_key_env = \"P{n}_KEY\"\n",
            provider.base
        ));
        names.push(format!("\"p{n}\""));
    }
    toml.push_str(&format!(
        "[[models]]\nname = \"{EMBEDDING_MODEL}\"\nprotocol = \"embeddings\"\nprice = {EMBEDDING_PRICE}\nupstreams = [{}]\n",
        names.join(", ")
    ));
    Catalogue::from_toml(&toml).unwrap()
}

const PROVIDER_REPLY: &str = r#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":"AACAPwAAAEA="}],"model":"text-embedding-3-small","usage":{"prompt_tokens":7,"total_tokens":7}}"#;

#[tokio::test]
async fn an_embeddings_call_goes_to_the_providers_embeddings_and_back_byte_for_byte() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    provider.then(Fault::json(200, PROVIDER_REPLY));
    let gateway = http_gateway(&db, embeddings_catalogue(&[&provider])).await;
    let key = db.funded_key(10, 0).await;
    let sent = r#"{"input": ["tokens", [1, 2]], "model": "text-embedding-3-small", "encoding_format": "base64", "user": "u-1"}"#;
    let answer = gateway.post_bearer(EMBEDDINGS, &key, sent).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.bytes, PROVIDER_REPLY.as_bytes());
    let seen = provider.last();
    assert_eq!(seen.target, "/v1/embeddings");
    assert_eq!(seen.body, sent.as_bytes());
    assert_eq!(seen.header("authorization"), Some("Bearer sk-provider"));
    let [call] = db.calls(&key).await.try_into().unwrap();
    assert_eq!((call.status, call.input_tokens), (CallStatus::Ok, Some(7)));
    assert_eq!(db.balance(&key).await, balance(10 - EMBEDDING_PRICE, 0));
}

#[tokio::test]
async fn a_failed_embeddings_call_fails_over_and_is_refunded_when_every_channel_fails() {
    let db = local_db().await;
    let (first, second) = (FakeProvider::start().await, FakeProvider::start().await);
    let gateway = http_gateway(&db, embeddings_catalogue(&[&first, &second])).await;
    let key = db.funded_key(10, 0).await;
    let body = json!({ "model": EMBEDDING_MODEL, "input": "x" }).to_string();

    first.then(Fault::json(500, r#"{"error":{"message":"down"}}"#));
    second.then(Fault::json(200, PROVIDER_REPLY));
    let answer = gateway.post_bearer(EMBEDDINGS, &key, body.clone()).await;
    assert_eq!(answer.status, 200);
    assert_eq!(db.calls(&key).await[0].channel.as_deref(), Some("p1"));

    first.always(Fault::json(500, r#"{"error":{"message":"down"}}"#));
    second.always(Fault::json(503, r#"{"error":{"message":"down"}}"#));
    let failed = gateway.post_bearer(EMBEDDINGS, &key, body).await;
    assert_eq!(
        (failed.status, failed.detail()),
        (502, "上游服务暂时不可用")
    );
    assert_eq!(db.calls(&key).await[0].status, CallStatus::Refunded);
    assert_eq!(db.balance(&key).await, balance(10 - EMBEDDING_PRICE, 0));
    db.assert_audit_holds().await;
}
