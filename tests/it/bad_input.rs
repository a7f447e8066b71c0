//! Arbitrary requests thrown at the gateway over HTTP (on every protocol's paths, Google's
//! Gemini API's too): bodies, headers, methods and paths. Every
//! refusal is a 4xx with a JSON `detail`, nothing is charged for it, the server never answers
//! 5xx, and the books still balance afterwards.

use crate::common;

use common::*;
use model_gateway::store::CallStatus;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

#[derive(Debug, Clone)]
struct Attempt {
    method: &'static str,
    path: String,
    auth: Auth,
    content_type: Option<String>,
    body: Vec<u8>,
}

#[derive(Debug, Clone)]
enum Auth {
    None,
    Bearer,
    XApiKey,
    /// Google's header.
    XGoogApiKey,
    Garbage(String),
}

/// The demo's Gemini model priced per call, and its call paths.
const GEMINI_MODEL: &str = "gemini-3.5-flash-lite";

fn gemini_call() -> String {
    format!("/v1beta/models/{GEMINI_MODEL}:generateContent")
}

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(serde_json::Value::from),
        ".{0,12}".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            prop::collection::btree_map(".{0,6}", inner, 0..4)
                .prop_map(|map| serde_json::Value::Object(map.into_iter().collect())),
        ]
    })
}

/// A request body that is often nearly right: the fields the gateway reads, each either valid,
/// missing, or of a random type, plus random extra fields.
fn request_body() -> impl Strategy<Value = Vec<u8>> {
    let model = prop_oneof![
        Just(Some(serde_json::json!(CHAT_MODEL))),
        Just(Some(serde_json::json!(MESSAGES_MODEL))),
        Just(Some(serde_json::json!("no-such-model"))),
        Just(None),
        json_value().prop_map(Some),
    ];
    let messages = prop_oneof![
        Just(Some(
            serde_json::json!([{ "role": "user", "content": "hi" }])
        )),
        Just(None),
        json_value().prop_map(Some),
    ];
    let max_tokens = prop_oneof![
        Just(Some(serde_json::json!(16))),
        Just(None),
        json_value().prop_map(Some)
    ];
    let stream = prop_oneof![
        Just(None),
        Just(Some(serde_json::json!(true))),
        json_value().prop_map(Some)
    ];
    let structured = (
        model,
        messages,
        max_tokens,
        stream,
        prop::collection::btree_map("[a-z_]{1,8}", json_value(), 0..3),
    )
        .prop_map(|(model, messages, max_tokens, stream, extra)| {
            let mut object: serde_json::Map<String, serde_json::Value> =
                extra.into_iter().collect();
            for (name, value) in [
                ("model", model),
                ("messages", messages),
                ("max_tokens", max_tokens),
                ("stream", stream),
            ] {
                if let Some(value) = value {
                    object.insert(name.to_owned(), value);
                }
            }
            serde_json::Value::Object(object).to_string().into_bytes()
        });
    let contents = prop_oneof![
        Just(serde_json::json!([{ "role": "user", "parts": [{ "text": "hi" }] }])),
        json_value(),
    ];
    let gemini = (contents, json_value()).prop_map(|(contents, config)| {
        serde_json::json!({ "contents": contents, "generationConfig": config })
            .to_string()
            .into_bytes()
    });
    prop_oneof![
        3 => Just(chat_body(CHAT_MODEL).into_bytes()),
        3 => Just(messages_body(MESSAGES_MODEL).into_bytes()),
        2 => Just(br#"{"contents":[{"role":"user","parts":[{"text":"hi"}]}]}"#.to_vec()),
        2 => gemini,
        4 => structured,
        1 => prop::collection::vec(any::<u8>(), 0..256),
        1 => json_value().prop_map(|v| v.to_string().into_bytes()),
        1 => (request_prefix(), 0..40usize).prop_map(|(body, cut)| body[..body.len().saturating_sub(cut)].to_vec()),
    ]
}

fn request_prefix() -> impl Strategy<Value = Vec<u8>> {
    Just(chat_body(CHAT_MODEL).into_bytes())
}

fn attempt() -> impl Strategy<Value = Attempt> {
    let method =
        prop_oneof![8 => Just("POST"), 1 => Just("GET"), 1 => Just("PUT"), 1 => Just("DELETE")];
    let path = prop_oneof![
        4 => Just(CHAT.to_owned()),
        4 => Just(MESSAGES.to_owned()),
        4 => Just(gemini_call()),
        1 => Just(format!("/v1/models/{GEMINI_MODEL}:generateContent")),
        1 => Just(format!("/v1beta/models/{GEMINI_MODEL}:streamGenerateContent?alt=sse")),
        1 => Just(format!("/v1beta/models/{CHAT_MODEL}:generateContent")),
        1 => "/v1beta/models/[a-z0-9.:-]{0,24}",
        1 => Just("/v1/messages/".to_owned()),
        1 => Just("/v1//chat/completions".to_owned()),
        1 => Just("/v1/chat/completions?stream=true".to_owned()),
        1 => "/[a-zA-Z0-9/._~-]{0,30}",
        // The key holders' endpoints and the probes: never charged.
        1 => prop_oneof![
            Just("/v1/models".to_owned()),
            "/v1/models/[a-z0-9.-]{0,16}",
            "/v1/models\\?(limit|after_id|before_id)=[a-z0-9-]{0,6}",
            Just("/v1/balance".to_owned()),
            "/v1/calls\\?(limit|before)=-?[a-z0-9]{0,5}",
            Just("/v1/messages/count_tokens".to_owned()),
            Just("/v1beta/models".to_owned()),
            "/v1beta/models\\?(pageSize|pageToken)=[a-z0-9-]{0,6}",
            Just(format!("/v1beta/models/{GEMINI_MODEL}:countTokens")),
            Just("/health".to_owned()),
            Just("/ready".to_owned()),
            Just("/".to_owned()),
        ],
    ];
    let auth = prop_oneof![
        1 => Just(Auth::None),
        3 => Just(Auth::Bearer),
        3 => Just(Auth::XApiKey),
        2 => Just(Auth::XGoogApiKey),
        1 => "[ -~]{0,40}".prop_map(Auth::Garbage),
    ];
    let content_type = prop_oneof![
        Just(Some("application/json".to_owned())),
        Just(None),
        "[ -~]{0,20}".prop_map(Some)
    ];
    (method, path, auth, content_type, request_body()).prop_map(
        |(method, path, auth, content_type, body)| Attempt {
            method,
            path,
            auth,
            content_type,
            body,
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arbitrary_requests_are_refused_with_a_4xx_detail_and_never_charged() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(1_000_000, 0).await;
    let runtime = tokio::runtime::Handle::current();
    let successes = std::sync::atomic::AtomicUsize::new(0);

    let mut runner = TestRunner::new(Config {
        cases: 1000,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&attempt(), |attempt| {
        let answer = tokio::task::block_in_place(|| {
            runtime.block_on(async {
                let method = reqwest::Method::from_bytes(attempt.method.as_bytes()).unwrap();
                let mut request = gateway
                    .client
                    .request(method, format!("{}{}", gateway.base, attempt.path))
                    .body(attempt.body.clone());
                request = match &attempt.auth {
                    Auth::None => request,
                    Auth::Bearer => request.bearer_auth(&key),
                    Auth::XApiKey => request.header("x-api-key", &key),
                    Auth::XGoogApiKey => request.header("x-goog-api-key", &key),
                    Auth::Garbage(value) => request.header("authorization", value.as_str()),
                };
                if let Some(content_type) = &attempt.content_type {
                    request = request.header("content-type", content_type.as_str());
                }
                gateway.send(request).await
            })
        });
        prop_assert!(
            answer.status != 500 && answer.status < 502,
            "{attempt:?} -> {answer:?}"
        );
        let route = attempt.path.split('?').next().unwrap_or_default();
        let a_call = attempt.method == "POST"
            && (route == CHAT
                || route == MESSAGES
                || model_gateway::Protocol::from_path(route)
                    == Some(model_gateway::Protocol::Gemini));
        if answer.status == 200 {
            if a_call {
                successes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        } else {
            prop_assert!(
                (400..500).contains(&answer.status),
                "{attempt:?} -> {answer:?}"
            );
            let detail = answer.body["detail"].as_str();
            prop_assert!(
                detail.is_some_and(|d| !d.is_empty()),
                "{attempt:?} -> {answer:?}"
            );
        }
        Ok(())
    });
    result.unwrap();
    let successes = successes.into_inner();

    // Exactly the successful calls were charged, each its price.
    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), successes);
    assert!(calls.iter().all(|c| c.status == CallStatus::Ok));
    let charged: i64 = calls.iter().map(|c| c.price.get()).sum();
    assert_eq!(db.balance(&key).await.total().get(), 1_000_000 - charged);
    assert!(
        successes > 10,
        "the generator should reach the upstream sometimes ({successes})"
    );
    db.assert_audit_holds().await;
}

/// Sends `head` and then up to `body_bytes` of body in 64 KiB chunks, stopping early if the
/// server answers; returns the status line and how much body was sent.
async fn raw_request(base: &str, head: &str, body_bytes: usize, chunked: bool) -> (String, usize) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = base.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    let chunk = vec![b'x'; 64 * 1024];
    let mut sent = 0;
    let mut answer = vec![0u8; 4096];
    while sent < body_bytes {
        let write = async {
            if chunked {
                stream
                    .write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
                    .await?;
                stream.write_all(&chunk).await?;
                stream.write_all(b"\r\n").await
            } else {
                stream.write_all(&chunk).await
            }
        };
        match tokio::time::timeout(std::time::Duration::from_secs(5), write).await {
            Ok(Ok(())) => sent += chunk.len(),
            _ => break, // the server stopped reading: it has answered or closed
        }
        if sent % (4 << 20) == 0 {
            let peek = tokio::time::timeout(
                std::time::Duration::from_millis(1),
                stream.peek(&mut answer),
            )
            .await;
            if matches!(peek, Ok(Ok(n)) if n > 0) {
                break;
            }
        }
    }
    let read = tokio::time::timeout(std::time::Duration::from_secs(5), stream.read(&mut answer))
        .await
        .expect("the server answers")
        .unwrap_or(0);
    let text = String::from_utf8_lossy(&answer[..read]).into_owned();
    (text, sent)
}

#[tokio::test]
async fn a_declared_1_gib_body_is_refused_before_it_is_read() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let head = format!(
        "POST {CHAT} HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        1u64 << 30
    );
    let (answer, sent) = raw_request(&gateway.base, &head, 0, false).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("请求体过大"), "{answer}");
    assert_eq!(sent, 0);
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

#[tokio::test]
async fn an_endless_chunked_body_is_cut_at_the_limit() {
    let db = local_db().await;
    let gateway = start_gateway(
        &db,
        model_gateway::Catalogue::demo(),
        model_gateway::Upstream::Mock(model_gateway::upstream::MockUpstream::new()),
        1 << 20,
    )
    .await;
    let key = db.funded_key(10, 0).await;
    let head = format!(
        "POST {CHAT} HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer {key}\r\ntransfer-encoding: chunked\r\n\r\n"
    );
    // Up to 64 MiB offered; the gateway must answer long before taking it all.
    let (answer, sent) = raw_request(&gateway.base, &head, 64 << 20, true).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(sent < 64 << 20, "the whole body was read ({sent} bytes)");
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

#[tokio::test]
async fn an_oversized_header_block_is_refused_and_the_server_keeps_serving() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let head = format!(
        "POST {CHAT} HTTP/1.1\r\nhost: gateway\r\nx-padding: {}\r\ncontent-length: 0\r\n\r\n",
        "a".repeat(2 << 20)
    );
    let (answer, _) = raw_request(&gateway.base, &head, 0, false).await;
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 431"),
        "{answer}"
    );
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
}
