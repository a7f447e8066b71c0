//! The upstream path against fake providers started by the test: fidelity (byte-exact both
//! ways, headers), channels and failover, retries, the circuit breaker, deadlines, and what the
//! client and the operator learn of provider failures.

use crate::common;

use std::time::{Duration, Instant};

use common::fake_provider::{FakeProvider, Fault};
use common::*;
use model_gateway::{Catalogue, Upstream, store::CallStatus, upstream::HttpUpstream};

/// A gateway on a fresh `SQLite` file in front of the given catalogue, with a funded key.
struct Rig {
    db: TestDb,
    gateway: Gateway,
    key: String,
}

/// Every provider key is `secret-for-VARIABLE`.
fn provider_secret(variable: &str) -> String {
    format!("secret-for-{variable}")
}

fn upstream(name: &str, kind: &str, base_url: &str, extra: &str) -> String {
    format!(
        "[[upstreams]]\nname = \"{name}\"\nkind = \"{kind}\"\nbase_url = \"{base_url}\"\napi_key_env = \"{}\"\n{extra}\n",
        name.to_uppercase().replace('-', "_")
    )
}

fn chat_model(name: &str, price: i64, channels: &str) -> String {
    format!(
        "[[models]]\nname = \"{name}\"\nprotocol = \"chat_completions\"\nprice = {price}\n{channels}\n"
    )
}

async fn rig(catalogue_toml: String) -> Rig {
    let catalogue = Catalogue::from_toml(&catalogue_toml).unwrap();
    let upstream =
        HttpUpstream::with_keys(&catalogue, |variable| Some(provider_secret(variable))).unwrap();
    let db = local_db().await;
    let gateway = start_gateway(&db, catalogue, Upstream::Http(upstream), 64 << 20).await;
    let key = db.funded_key(1_000, 0).await;
    Rig { db, gateway, key }
}

impl Rig {
    async fn chat(&self, model: &str) -> Answer {
        self.gateway.chat(&self.key, model).await
    }

    async fn total(&self) -> i64 {
        self.db.balance(&self.key).await.total().get()
    }

    async fn newest_call(&self) -> model_gateway::store::CallRecord {
        self.db.calls(&self.key).await.remove(0)
    }
}

const OK_REPLY: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}"#;

fn ok() -> Fault {
    Fault::json(200, OK_REPLY)
}

// ---------------------------------------------------------------------------------------------
// Fidelity

/// One fake provider serving a chat model and a messages model.
async fn one_provider_rig() -> (FakeProvider, Rig) {
    let provider = FakeProvider::start().await;
    let toml = format!(
        "{}{}{}[[models]]\nname = \"{MESSAGES_MODEL}\"\nprotocol = \"messages\"\nprice = {MESSAGES_PRICE}\nupstream = \"fake-anthropic\"\n",
        upstream(
            "fake-openai",
            "openai",
            &format!("{}/v1", provider.base),
            ""
        ),
        upstream("fake-anthropic", "anthropic", &provider.base, ""),
        chat_model(CHAT_MODEL, CHAT_PRICE, "upstream = \"fake-openai\""),
    );
    (provider, rig(toml).await)
}

fn reported_usage(reply: &[u8]) -> (Option<i64>, Option<i64>) {
    let reply: serde_json::Value = serde_json::from_slice(reply).unwrap();
    let usage = &reply["usage"];
    let pick = |a: &str, b: &str| usage[a].as_i64().or(usage[b].as_i64());
    (
        pick("prompt_tokens", "input_tokens"),
        pick("completion_tokens", "output_tokens"),
    )
}

#[tokio::test]
async fn the_corpus_crosses_the_gateway_byte_for_byte_on_both_protocols() {
    let (provider, rig) = one_provider_rig().await;
    let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let mut cases = 0;
    for (directory, path) in [("chat_completions", CHAT), ("messages", MESSAGES)] {
        let mut requests: Vec<_> = std::fs::read_dir(corpus.join(directory))
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter(|p| p.to_string_lossy().ends_with(".request.json"))
            .collect();
        requests.sort();
        for request_path in requests {
            let name = request_path.display().to_string();
            let request = std::fs::read(&request_path).unwrap();
            let reply = std::fs::read(name.replace(".request.json", ".reply.json")).unwrap();
            provider.then(Fault::Reply {
                status: 200,
                headers: Vec::new(),
                body: reply.clone(),
            });

            let answer = rig
                .gateway
                .post_bearer(path, &rig.key, request.clone())
                .await;

            assert_eq!(answer.status, 200, "{name}: {answer:?}");
            assert_eq!(
                answer.bytes, reply,
                "{name}: the reply changed on the way back"
            );
            assert_eq!(
                provider.last().body,
                request,
                "{name}: the request changed on the way"
            );
            let call = rig.newest_call().await;
            assert_eq!(call.status, CallStatus::Ok, "{name}");
            assert_eq!(
                (call.input_tokens, call.output_tokens),
                reported_usage(&reply),
                "{name}"
            );
            cases += 1;
        }
    }
    assert!(cases >= 12, "only {cases} corpus cases");
}

#[tokio::test]
async fn very_long_unicode_contents_cross_byte_for_byte() {
    let (provider, rig) = one_provider_rig().await;
    let long = "长文本 · émojis 🚀 \"quotes\" \\ tabs\t ".repeat(120_000); // ~4.7 MB
    let request = serde_json::json!({
        "model": CHAT_MODEL,
        "messages": [{ "role": "user", "content": long }]
    })
    .to_string();
    let reply = OK_REPLY.replace("\"hi\"", &serde_json::to_string(&long).unwrap());
    provider.then(Fault::json(200, &reply));

    let answer = rig
        .gateway
        .post_bearer(CHAT, &rig.key, request.clone())
        .await;

    assert_eq!(answer.status, 200);
    assert!(answer.bytes == reply.as_bytes(), "the long reply changed");
    assert!(
        provider.last().body == request.as_bytes(),
        "the long request changed"
    );
}

#[tokio::test]
async fn headers_that_matter_reach_the_provider_and_the_gateway_key_never_does() {
    let (provider, rig) = one_provider_rig().await;
    let forwarded_chat = [
        ("openai-organization", "org-123"),
        ("openai-project", "proj_9"),
        ("idempotency-key", "idem-1"),
        (
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ),
        ("x-request-id", "req-42"),
    ];
    provider.then(ok());
    let mut request = rig
        .gateway
        .client
        .post(format!("{}{CHAT}", rig.gateway.base))
        .bearer_auth(&rig.key)
        .header("x-api-key", &rig.key)
        .header("cookie", "session=abc")
        .body(chat_body(CHAT_MODEL));
    for (name, value) in forwarded_chat {
        request = request.header(name, value);
    }
    assert_eq!(rig.gateway.send(request).await.status, 200);
    let seen = provider.last();
    assert_eq!(seen.target, "/v1/chat/completions");
    for (name, value) in forwarded_chat {
        assert_eq!(seen.header(name), Some(value), "{name}");
    }
    let bearer = format!("Bearer {}", provider_secret("FAKE_OPENAI"));
    assert_eq!(seen.header("authorization"), Some(bearer.as_str()));
    assert_eq!(seen.header("x-api-key"), None);
    assert_eq!(seen.header("cookie"), None);
    assert!(seen.headers.iter().all(|(_, v)| !v.contains(&rig.key)));

    let forwarded_messages = [
        ("anthropic-version", "2023-01-01"),
        (
            "anthropic-beta",
            "prompt-caching-2024-07-31,tools-2024-05-16",
        ),
        ("idempotency-key", "idem-2"),
        (
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01",
        ),
    ];
    provider.then(Fault::json(200, r#"{"type":"message","content":[]}"#));
    let mut request = rig
        .gateway
        .client
        .post(format!("{}{MESSAGES}", rig.gateway.base))
        .header("x-api-key", &rig.key)
        .body(messages_body(MESSAGES_MODEL));
    for (name, value) in forwarded_messages {
        request = request.header(name, value);
    }
    assert_eq!(rig.gateway.send(request).await.status, 200);
    let seen = provider.last();
    assert_eq!(seen.target, "/v1/messages");
    for (name, value) in forwarded_messages {
        assert_eq!(seen.header(name), Some(value), "{name}");
    }
    let secret = provider_secret("FAKE_ANTHROPIC");
    assert_eq!(seen.header("x-api-key"), Some(secret.as_str()));
    assert_eq!(seen.header("authorization"), None);
    assert!(seen.headers.iter().all(|(_, v)| !v.contains(&rig.key)));
}

#[tokio::test]
async fn anthropic_version_defaults_when_the_client_sends_none() {
    let (provider, rig) = one_provider_rig().await;
    provider.then(Fault::json(200, r#"{"type":"message","content":[]}"#));
    assert_eq!(
        rig.gateway.messages(&rig.key, MESSAGES_MODEL).await.status,
        200
    );
    assert_eq!(
        provider.last().header("anthropic-version"),
        Some("2023-06-01")
    );
}

// ---------------------------------------------------------------------------------------------
// Channels, retries and failover

/// `primary` then `backup`, each its own fake provider; the primary's time-out is 1 s unless
/// `primary_extra` sets one.
async fn two_channel_rig(
    primary_extra: &str,
    backup_extra: &str,
    deadline: Option<u64>,
) -> (FakeProvider, FakeProvider, Rig) {
    let primary = FakeProvider::start().await;
    let backup = FakeProvider::start().await;
    let deadline = deadline.map_or(String::new(), |secs| {
        format!("call_deadline_secs = {secs}\n")
    });
    let toml = format!(
        "{deadline}{}{}{}",
        upstream(
            "primary",
            "openai",
            &format!("{}/v1", primary.base),
            &if primary_extra.contains("timeout_secs") {
                primary_extra.to_owned()
            } else {
                format!("timeout_secs = 1\n{primary_extra}")
            }
        ),
        upstream(
            "backup",
            "openai",
            &format!("{}/v1", backup.base),
            backup_extra
        ),
        chat_model(
            CHAT_MODEL,
            CHAT_PRICE,
            "upstreams = [{ name = \"primary\", upstream_model = \"name-on-primary\" }, { name = \"backup\", upstream_model = \"name-on-backup\" }]"
        ),
    );
    (primary, backup, rig(toml).await)
}

#[tokio::test]
async fn each_retryable_failure_moves_on_to_the_next_channel_and_charges_once() {
    let (primary, backup, rig) = two_channel_rig("breaker_failures = 1000", "", None).await;
    let faults = [
        ("500", Fault::json(500, r#"{"error":{"message":"boom"}}"#)),
        ("503", Fault::json(503, "overloaded")),
        (
            "429",
            Fault::json(429, r#"{"error":{"message":"slow down"}}"#),
        ),
        (
            "401 (the channel's key)",
            Fault::json(401, r#"{"error":{"message":"bad key"}}"#),
        ),
        ("connection reset", Fault::Reset),
        ("garbage", Fault::Garbage),
        ("time-out", ok().after(Duration::from_secs(3))),
        ("2xx not JSON", Fault::json(200, "<html>maintenance</html>")),
    ];
    for (case, fault) in faults {
        let before = rig.total().await;
        let primary_before = primary.requests();
        primary.then(fault);
        backup.then(ok());

        let answer = rig.chat(CHAT_MODEL).await;

        assert_eq!(answer.status, 200, "{case}: {answer:?}");
        assert_eq!(answer.bytes, OK_REPLY.as_bytes(), "{case}");
        assert_eq!(
            rig.total().await,
            before - CHAT_PRICE,
            "{case}: charged once"
        );
        assert_eq!(primary.requests(), primary_before + 1, "{case}");
        let call = rig.newest_call().await;
        assert_eq!(call.status, CallStatus::Ok, "{case}");
        assert_eq!(call.channel.as_deref(), Some("backup"), "{case}");
    }
    // Each channel got the model under its own upstream name.
    let model_of =
        |body: &[u8]| serde_json::from_slice::<serde_json::Value>(body).unwrap()["model"].clone();
    assert_eq!(model_of(&primary.last().body), "name-on-primary");
    assert_eq!(model_of(&backup.last().body), "name-on-backup");
    assert_eq!(rig.db.calls(&rig.key).await.len(), 8);
    rig.db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_refused_connection_moves_on_to_the_next_channel() {
    let backup = FakeProvider::start().await;
    let closed_port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let rig = rig(format!(
        "{}{}{}",
        upstream(
            "dead",
            "openai",
            &format!("http://127.0.0.1:{closed_port}/v1"),
            ""
        ),
        upstream("backup", "openai", &format!("{}/v1", backup.base), ""),
        chat_model(CHAT_MODEL, CHAT_PRICE, "upstreams = [\"dead\", \"backup\"]"),
    ))
    .await;
    backup.then(ok());
    assert_eq!(rig.chat(CHAT_MODEL).await.status, 200);
    assert_eq!(rig.newest_call().await.channel.as_deref(), Some("backup"));
}

#[tokio::test]
async fn a_request_the_provider_rejects_is_refunded_at_once_and_the_client_learns_why() {
    let (primary, backup, rig) = two_channel_rig("", "", None).await;
    let before = rig.total().await;
    primary.then(Fault::json(
        400,
        r#"{"error":{"message":"Invalid 'messages[0].role': 'robot'.","type":"invalid_request_error"}}"#,
    ));

    let answer = rig.chat(CHAT_MODEL).await;

    assert_eq!(answer.status, 502);
    assert_eq!(
        answer.detail(),
        "上游服务暂时不可用: Invalid 'messages[0].role': 'robot'."
    );
    assert_eq!(
        backup.requests(),
        0,
        "a request error is not retried elsewhere"
    );
    assert_eq!(rig.total().await, before);
    let call = rig.newest_call().await;
    assert_eq!(call.status, CallStatus::Refunded);
    assert_eq!(call.upstream_status, Some(400));
    assert!(
        call.upstream_error
            .unwrap()
            .contains("invalid_request_error")
    );
}

#[tokio::test]
async fn the_anthropic_error_shape_also_reaches_the_client() {
    let (provider, rig) = one_provider_rig().await;
    provider.then(Fault::json(
        400,
        r#"{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: 64000 > 8192"}}"#,
    ));
    let answer = rig.gateway.messages(&rig.key, MESSAGES_MODEL).await;
    assert_eq!(answer.status, 502);
    assert_eq!(
        answer.detail(),
        "上游服务暂时不可用: max_tokens: 64000 > 8192"
    );
}

#[tokio::test]
async fn when_every_channel_fails_the_call_is_refunded_once_and_each_failure_is_logged() {
    let (primary, backup, rig) = two_channel_rig("", "", None).await;
    let before = rig.total().await;
    primary.then(Fault::json(500, r#"{"error":{"message":"primary down"}}"#));
    backup.then(Fault::Reset);

    let answer = rig.chat(CHAT_MODEL).await;

    assert_eq!(answer.status, 502);
    assert_eq!(answer.detail(), "上游服务暂时不可用");
    assert_eq!(rig.total().await, before);
    let calls = rig.db.calls(&rig.key).await;
    assert_eq!(calls.len(), 1);
    let error = calls[0].upstream_error.clone().unwrap();
    assert!(
        error.contains("primary: answered 500") && error.contains("primary down"),
        "{error}"
    );
    assert!(error.contains("backup: "), "{error}");
    rig.db.assert_audit_holds().await;
}

#[tokio::test]
async fn retry_after_is_honoured_within_the_call_deadline() {
    let provider = FakeProvider::start().await;
    let rig = rig(format!(
        "{}{}",
        upstream("only", "openai", &format!("{}/v1", provider.base), ""),
        chat_model(CHAT_MODEL, CHAT_PRICE, "upstream = \"only\""),
    ))
    .await;
    provider.then(Fault::json(429, "{}").with_header("retry-after", "1"));
    provider.then(ok());
    let before = rig.total().await;

    let started = Instant::now();
    let answer = rig.chat(CHAT_MODEL).await;

    assert_eq!(answer.status, 200);
    assert!(started.elapsed() >= Duration::from_secs(1), "did not wait");
    assert_eq!(provider.requests(), 2);
    assert_eq!(rig.total().await, before - CHAT_PRICE);
}

#[tokio::test]
async fn a_retry_after_beyond_the_deadline_is_not_awaited() {
    let provider = FakeProvider::start().await;
    let rig = rig(format!(
        "call_deadline_secs = 5\n{}{}",
        upstream("only", "openai", &format!("{}/v1", provider.base), ""),
        chat_model(CHAT_MODEL, CHAT_PRICE, "upstream = \"only\""),
    ))
    .await;
    provider.then(Fault::json(429, "{}").with_header("retry-after", "60"));

    let started = Instant::now();
    let answer = rig.chat(CHAT_MODEL).await;

    assert_eq!(answer.status, 502);
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "waited past the deadline"
    );
    assert_eq!(provider.requests(), 1);
    assert_eq!(rig.newest_call().await.upstream_status, Some(429));
}

#[tokio::test]
async fn the_call_deadline_bounds_all_attempts_together() {
    let (primary, backup, rig) = two_channel_rig("timeout_secs = 30", "", Some(2)).await;
    primary.then(ok().after(Duration::from_secs(10)));
    backup.then(ok().after(Duration::from_secs(10)));
    let before = rig.total().await;

    let started = Instant::now();
    let answer = rig.chat(CHAT_MODEL).await;

    let elapsed = started.elapsed();
    assert_eq!(answer.status, 502);
    assert!(
        elapsed >= Duration::from_secs(2) && elapsed < Duration::from_secs(4),
        "{elapsed:?}"
    );
    assert_eq!(rig.total().await, before);
    assert_eq!(backup.requests(), 0, "no time was left for the backup");
}

#[tokio::test]
async fn a_failing_channel_is_skipped_while_its_breaker_is_open_and_tried_after_the_cooldown() {
    let (primary, backup, rig) =
        two_channel_rig("breaker_failures = 2\nbreaker_cooldown_secs = 1", "", None).await;
    primary.always(Fault::json(500, "{}"));
    backup.always(ok());

    for expected_primary_requests in [1, 2, 2, 2] {
        assert_eq!(rig.chat(CHAT_MODEL).await.status, 200);
        assert_eq!(
            primary.requests(),
            expected_primary_requests,
            "breaker after 2 failures"
        );
        assert_eq!(rig.newest_call().await.channel.unwrap(), "backup");
    }

    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(rig.chat(CHAT_MODEL).await.status, 200);
    assert_eq!(primary.requests(), 3, "one trial after the cooldown");
    assert_eq!(rig.chat(CHAT_MODEL).await.status, 200);
    assert_eq!(
        primary.requests(),
        3,
        "the failed trial reopened the breaker"
    );

    primary.always(ok());
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(rig.chat(CHAT_MODEL).await.status, 200);
    assert_eq!(
        rig.newest_call().await.channel.unwrap(),
        "primary",
        "the trial succeeded"
    );
    assert_eq!(rig.chat(CHAT_MODEL).await.status, 200);
    assert_eq!(
        rig.newest_call().await.channel.unwrap(),
        "primary",
        "the breaker is closed again"
    );
    assert_eq!(primary.requests(), 5);
}

#[tokio::test]
async fn when_every_breaker_is_open_the_channels_are_still_tried() {
    let breaker = "breaker_failures = 1\nbreaker_cooldown_secs = 60";
    let (primary, backup, rig) = two_channel_rig(breaker, breaker, None).await;
    primary.always(Fault::json(500, "{}"));
    backup.then(Fault::json(500, "{}")).then(ok());
    // One failure each opens both breakers for a minute.
    assert_eq!(rig.chat(CHAT_MODEL).await.status, 502);
    // With every breaker open, the call still tries them all rather than fail untried.
    assert_eq!(rig.chat(CHAT_MODEL).await.status, 200);
    assert_eq!((primary.requests(), backup.requests()), (2, 2));
    assert_eq!(rig.newest_call().await.channel.as_deref(), Some("backup"));
}

#[tokio::test]
async fn equal_priorities_share_calls_by_weight() {
    let a = FakeProvider::start().await;
    let b = FakeProvider::start().await;
    a.always(ok());
    b.always(ok());
    let rig = rig(format!(
        "{}{}{}",
        upstream("a", "openai", &format!("{}/v1", a.base), ""),
        upstream("b", "openai", &format!("{}/v1", b.base), ""),
        chat_model(
            "spread",
            1,
            "upstreams = [{ name = \"a\", priority = 1, weight = 3 }, { name = \"b\", priority = 1, weight = 1 }]"
        ),
    ))
    .await;
    for _ in 0..200 {
        assert_eq!(rig.chat("spread").await.status, 200);
    }
    // Expected 150 : 50; the bounds are five standard deviations wide.
    assert_eq!(a.requests() + b.requests(), 200);
    assert!(
        (120..=180).contains(&a.requests()),
        "a served {}",
        a.requests()
    );
}

#[tokio::test]
async fn one_connection_per_upstream_is_kept_alive_across_calls() {
    let (provider, rig) = one_provider_rig().await;
    provider.always(ok());
    for _ in 0..5 {
        assert_eq!(rig.chat(CHAT_MODEL).await.status, 200);
    }
    assert_eq!(provider.requests(), 5);
    assert_eq!(provider.connections(), 1);
}

#[tokio::test]
async fn an_upstream_can_use_its_own_proxy_and_extra_headers() {
    let proxy = FakeProvider::start().await;
    proxy.then(ok());
    let rig = rig(format!(
        "{}{}",
        upstream(
            "proxied",
            "openai",
            "http://provider.invalid/v1",
            &format!(
                "proxy = \"{}\"\nheaders = {{ \"x-tenant\" = \"acme\" }}",
                proxy.base
            )
        ),
        chat_model(CHAT_MODEL, CHAT_PRICE, "upstream = \"proxied\""),
    ))
    .await;
    assert_eq!(rig.chat(CHAT_MODEL).await.status, 200);
    let seen = proxy.last();
    assert_eq!(seen.target, "http://provider.invalid/v1/chat/completions");
    assert_eq!(seen.header("x-tenant"), Some("acme"));
}

#[tokio::test]
async fn provider_credentials_never_reach_the_client_or_the_call_log() {
    let (primary, backup, rig) = two_channel_rig("", "", None).await;
    let secret = provider_secret("PRIMARY");
    primary.then(Fault::json(
        400,
        &format!(r#"{{"error":{{"message":"Incorrect API key provided: {secret}"}}}}"#),
    ));
    let answer = rig.chat(CHAT_MODEL).await;
    assert_eq!(answer.status, 502);
    assert!(!answer.detail().contains(&secret), "{}", answer.detail());
    assert!(answer.detail().contains("[redacted]"));
    let logged = rig.newest_call().await.upstream_error.unwrap();
    assert!(!logged.contains(&secret), "{logged}");

    primary.then(Fault::json(500, &format!("echo {secret}")));
    backup.then(Fault::json(
        500,
        &format!("echo {}", provider_secret("BACKUP")),
    ));
    assert_eq!(rig.chat(CHAT_MODEL).await.status, 502);
    let logged = rig.newest_call().await.upstream_error.unwrap();
    assert!(!logged.contains("secret-for-"), "{logged}");
    assert!(!logged.contains(&rig.key), "{logged}");
}

#[tokio::test]
async fn a_connect_that_hangs_is_cut_by_the_connect_time_out() {
    // A listener that never accepts, with its accept queue filled: the kernel then drops new
    // connection attempts, so connecting hangs (on loopback, no other host involved).
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let address = socket.local_addr().unwrap();
    let listener = socket.listen(0).unwrap();
    let mut fillers = Vec::new();
    for _ in 0..4 {
        if let Ok(Ok(stream)) = tokio::time::timeout(
            Duration::from_millis(200),
            tokio::net::TcpStream::connect(address),
        )
        .await
        {
            fillers.push(stream);
        }
    }
    let backup = FakeProvider::start().await;
    backup.then(ok());
    let rig = rig(format!(
        "{}{}{}",
        upstream(
            "stuck",
            "openai",
            &format!("http://{address}/v1"),
            "connect_timeout_secs = 1\ntimeout_secs = 60"
        ),
        upstream("backup", "openai", &format!("{}/v1", backup.base), ""),
        chat_model(
            CHAT_MODEL,
            CHAT_PRICE,
            "upstreams = [\"stuck\", \"backup\"]"
        ),
    ))
    .await;

    let started = Instant::now();
    let answer = rig.chat(CHAT_MODEL).await;

    let elapsed = started.elapsed();
    assert_eq!(answer.status, 200);
    assert!(
        elapsed >= Duration::from_millis(900) && elapsed < Duration::from_secs(5),
        "{elapsed:?}"
    );
    let call = rig.newest_call().await;
    assert_eq!(call.channel.as_deref(), Some("backup"));
    drop((listener, fillers));
}
