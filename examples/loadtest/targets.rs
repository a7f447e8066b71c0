//! What the load is driven against: the floors (a bare axum server, with and without a
//! journal) and the gateways (in memory, on `SQLite`, on `PostgreSQL`).

use std::sync::Arc;

use axum::body::Bytes;
use model_gateway::{
    Accounts, Catalogue, Credits, MemoryStore, Protocol, SeaOrmStore, Upstream, credits::Bucket,
    keys::NewApiKey, router::DEFAULT_MAX_BODY_BYTES, upstream::MockUpstream,
};
use sea_orm::{ConnectionTrait, Statement};
use tower::Service;

use crate::journal::Journal;

pub const BODY: &str =
    r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Hello, how are you today?"}]}"#;

/// [`BODY`]'s question to [`METERED_MODEL`].
pub const METERED_BODY: &str = r#"{"model":"gpt-4o-mini-metered","messages":[{"role":"user","content":"Hello, how are you today?"}]}"#;

/// [`BODY`]'s question to a token-priced model with cost prices and tiers (`economics.rs`).
pub const COSTED_BODY: &str = r#"{"model":"gpt-4o-mini-costed","messages":[{"role":"user","content":"Hello, how are you today?"}]}"#;

/// `gpt-4o-mini` priced by tokens, beside the demo catalogue's per-call models.
pub const METERED_MODEL: &str = r#"
[[models]]
name = "gpt-4o-mini-metered"
protocol = "chat_completions"
upstream = "openai"
max_output_tokens = 1000
[models.tokens]
input = 15
output = 60
cache_read = 7.5
"#;

/// [`BODY`]'s question as a Responses request.
pub const RESPONSES_BODY: &str =
    r#"{"model":"gpt-4o-mini","input":[{"role":"user","content":"Hello, how are you today?"}]}"#;

/// [`BODY`]'s question as a messages request.
pub const MESSAGES_BODY: &str = r#"{"model":"gpt-4o-mini","max_tokens":256,"messages":[{"role":"user","content":"Hello, how are you today?"}]}"#;

/// [`BODY`]'s question to a model served by an Anthropic provider.
pub const CLAUDE_CHAT_BODY: &str =
    r#"{"model":"claude-load","messages":[{"role":"user","content":"Hello, how are you today?"}]}"#;

pub struct Target {
    pub name: &'static str,
    pub base: String,
    pub key: Option<String>,
    pub store: Option<Arc<SeaOrmStore>>,
}

pub async fn serve(router: axum::Router) -> String {
    let listener =
        model_gateway::server::bind("127.0.0.1:0", model_gateway::server::DEFAULT_LISTEN_BACKLOG)
            .await
            .unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    base
}

/// A gateway router behind the gateway's own server (`model_gateway::server`), as the example
/// gateway serves it.
async fn serve_gateway(router: axum::Router) -> String {
    let listener =
        model_gateway::server::bind("127.0.0.1:0", model_gateway::server::DEFAULT_LISTEN_BACKLOG)
            .await
            .unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let limits = model_gateway::server::ServerLimits::default();
    tokio::spawn(model_gateway::server::serve(
        listener,
        router,
        limits,
        std::future::pending(),
    ));
    base
}

/// What the floor answers: the body parsed as the gateway does, the mock's reply.
fn floor_reply(
    catalogue: &Catalogue,
    mock: MockUpstream,
    body: Bytes,
) -> http::Response<axum::body::Body> {
    let routed =
        model_gateway::router::route(catalogue, Protocol::ChatCompletions, &body, false).unwrap();
    mock_reply(mock, routed, body)
}

/// The mock's reply to a call routed as `routed`.
fn mock_reply(
    mut mock: MockUpstream,
    routed: model_gateway::call::RoutedCall,
    body: Bytes,
) -> http::Response<axum::body::Body> {
    let mut request = http::Request::new(body);
    request.extensions_mut().insert(routed);
    let reply = mock.call(request).into_inner().unwrap();
    reply.map(|body| axum::body::Body::from(body.as_complete().cloned().unwrap_or_default()))
}

/// The floor: parse the body as the gateway does, answer the mock reply, nothing else. With a
/// journal, the durable floor: each reply waits for a [`Journal`] record; no gateway that puts
/// each call on disk before answering can beat it on this machine.
pub async fn floor(journal: Option<Journal>) -> Target {
    let name = if journal.is_some() {
        "floor, durable"
    } else {
        "floor (no layers)"
    };
    let catalogue = Arc::new(Catalogue::demo());
    let mock = MockUpstream::new();
    let handler = move |body: Bytes| {
        let (catalogue, mock, journal) = (catalogue.clone(), mock.clone(), journal.clone());
        async move {
            let reply = floor_reply(&catalogue, mock, body);
            if let Some(journal) = journal {
                journal.record().await;
            }
            reply
        }
    };
    let router = axum::Router::new().route("/v1/chat/completions", axum::routing::post(handler));
    Target {
        name,
        base: serve(router).await,
        key: None,
        store: None,
    }
}

/// The skeleton: the floor served by the gateway's own server, doing per call the least any
/// gateway must: the bearer key's SHA-256 looked up among the keys, one credit taken from the
/// account's balance atomically (402 when there is none), the call's entry pushed on a log, a
/// request id on the answer. None of the gateway's layers and none of its other rules (key
/// limits, rate limits, refunds, the access line, error bodies): the gap between it and the
/// in-memory gateway is what those cost.
pub async fn skeleton() -> Target {
    use sha2::Digest;
    use std::sync::atomic::{AtomicI64, Ordering};
    let name = "skeleton (key, balance, log)";
    let key = NewApiKey::generate().reveal().to_owned();
    let digest = |key: &[u8]| -> [u8; 32] { sha2::Sha256::digest(key).into() };
    let keys = Arc::new(std::collections::HashMap::from([(
        digest(key.as_bytes()),
        1_u64,
    )]));
    let balance = Arc::new(AtomicI64::new(1 << 50));
    let log = Arc::new(std::sync::Mutex::new(Vec::<(u64, String)>::new()));
    let catalogue = Arc::new(Catalogue::demo());
    let mock = MockUpstream::new();
    let handler = move |headers: http::HeaderMap, body: Bytes| {
        let (catalogue, mock) = (catalogue.clone(), mock.clone());
        let (keys, balance, log) = (keys.clone(), balance.clone(), log.clone());
        async move {
            let refused = |status: http::StatusCode| {
                let mut refusal = http::Response::new(axum::body::Body::empty());
                *refusal.status_mut() = status;
                refusal
            };
            let bearer = headers
                .get(http::header::AUTHORIZATION)
                .and_then(|value| value.as_bytes().strip_prefix(b"Bearer "))
                .unwrap_or_default();
            let Some(account) = keys.get(&digest(bearer)).copied() else {
                return refused(http::StatusCode::UNAUTHORIZED);
            };
            if balance.fetch_sub(1, Ordering::AcqRel) < 1 {
                balance.fetch_add(1, Ordering::AcqRel);
                return refused(http::StatusCode::PAYMENT_REQUIRED);
            }
            let routed =
                model_gateway::router::route(&catalogue, Protocol::ChatCompletions, &body, false)
                    .unwrap();
            let model = routed.model.name.clone();
            let mut reply = mock_reply(mock, routed, body);
            log.lock().unwrap().push((account, model));
            let id = model_gateway::call::RequestId::generate();
            reply.headers_mut().insert(
                model_gateway::request_id::REQUEST_ID_HEADER,
                id.header_value().clone(),
            );
            reply
        }
    };
    let router = axum::Router::new().route("/v1/chat/completions", axum::routing::post(handler));
    Target {
        name,
        base: serve_gateway(router).await,
        key: Some(key),
        store: None,
    }
}

/// The full gateway on the in-memory store. It keeps no call log to check afterwards.
pub async fn memory_gateway() -> Target {
    let (router, key) = memory_router(Catalogue::demo(), Upstream::Mock(MockUpstream::new())).await;
    Target {
        name: "gateway, in-memory",
        base: serve_gateway(router).await,
        key: Some(key),
        store: None,
    }
}

/// The in-memory gateway in mock mode serving `catalogue`.
pub async fn memory_gateway_with(name: &'static str, catalogue: Catalogue) -> Target {
    let (router, key) = memory_router(catalogue, Upstream::Mock(MockUpstream::new())).await;
    Target {
        name,
        base: serve_gateway(router).await,
        key: Some(key),
        store: None,
    }
}

/// The gateway's router on an in-memory store with one funded key (returned).
async fn memory_router(catalogue: Catalogue, upstream: Upstream) -> (axum::Router, String) {
    let store = Arc::new(MemoryStore::new());
    let account = store.create_account("load").await.unwrap();
    let key = NewApiKey::generate();
    store.add_key(account, &key).await.unwrap();
    store
        .grant(account, Bucket::Subscription, Credits::new(1 << 50))
        .await
        .unwrap();
    let router = model_gateway::Gateway::new(store, Arc::new(catalogue), upstream)
        .body_limits(DEFAULT_MAX_BODY_BYTES)
        .router();
    (router, key.reveal().to_owned())
}

/// The full gateway on the in-memory store, calling `catalogue`'s providers over HTTP.
pub async fn memory_gateway_over_http(name: &'static str, catalogue: Catalogue) -> Target {
    let upstream =
        model_gateway::upstream::HttpUpstream::with_keys(&catalogue, |_| Some("sk-load".into()))
            .unwrap();
    let (router, key) = memory_router(catalogue, Upstream::Http(upstream)).await;
    Target {
        name,
        base: serve_gateway(router).await,
        key: Some(key),
        store: None,
    }
}

/// A store owning a new `SQLite` file `owned.db` in `dir`: the gateway's embedded default.
pub async fn owned_store(dir: &std::path::Path) -> SeaOrmStore {
    let url = format!("sqlite://{}?mode=rwc", dir.join("owned.db").display());
    SeaOrmStore::connect(&url)
        .await
        .unwrap()
        .own_file()
        .unwrap()
}

pub async fn gateway(name: &'static str, store: SeaOrmStore) -> Target {
    gateway_with(name, store, Catalogue::demo()).await
}

/// [`gateway`] serving `catalogue`.
pub async fn gateway_with(name: &'static str, store: SeaOrmStore, catalogue: Catalogue) -> Target {
    gateway_on(name, store, catalogue, Upstream::Mock(MockUpstream::new())).await
}

/// The gateway on `store`, calling `catalogue`'s providers over HTTP.
pub async fn owned_gateway_over_http(
    name: &'static str,
    store: SeaOrmStore,
    catalogue: Catalogue,
) -> Target {
    let upstream =
        model_gateway::upstream::HttpUpstream::with_keys(&catalogue, |_| Some("sk-load".into()))
            .unwrap();
    gateway_on(name, store, catalogue, Upstream::Http(upstream)).await
}

async fn gateway_on(
    name: &'static str,
    store: SeaOrmStore,
    catalogue: Catalogue,
    upstream: Upstream,
) -> Target {
    let store = Arc::new(store);
    let new = model_gateway::admin::NewAccount {
        name: "load".into(),
        subscription: 1 << 50,
        topup: 0,
    };
    let key = model_gateway::admin::Admin::new(store.clone())
        .create_account(&new)
        .await
        .unwrap()
        .key;
    let router = model_gateway::Gateway::new(store.clone(), Arc::new(catalogue), upstream)
        .body_limits(DEFAULT_MAX_BODY_BYTES)
        .router();
    Target {
        name,
        base: serve_gateway(router).await,
        key: Some(key),
        store: Some(store),
    }
}

/// The key a gateway binary's `keys create` command prints on its last line.
pub fn created_key(mut create: std::process::Command) -> String {
    let output = create.output().unwrap();
    assert!(output.status.success(), "keys create failed");
    String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .last()
        .unwrap()
        .to_owned()
}

pub async fn ok_entries(store: &SeaOrmStore) -> u64 {
    let connection = store.connection();
    let row = connection
        .query_one_raw(Statement::from_string(
            connection.get_database_backend(),
            "SELECT COUNT(*) AS n FROM mg_calls WHERE status = 'ok'",
        ))
        .await
        .unwrap()
        .unwrap();
    row.try_get::<i64>("", "n").unwrap() as u64
}
