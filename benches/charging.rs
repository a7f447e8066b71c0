//! The charging path: reserve+settle and reserve+refund on the in-memory store and on a SQLite
//! file in WAL mode (as deployed), one caller at a time; and one request through all four layers
//! against the bare mock upstream, so the layers' own cost shows.
//!
//! `cargo bench --bench charging`

use std::sync::Arc;

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http::Request;
use http_body_util::Full;
use model_gateway::{
    Bucket, CallFailure, CallSuccess, Caller, Catalogue, ChargeRequest, Credits, MemoryStore,
    MockUpstream, NewApiKey, Protocol, SeaOrmStore, Store,
};
use tower::{Service, ServiceExt};

async fn rich_caller<S: Store>(store: &S) -> (Caller, NewApiKey) {
    let account = store.create_account("bench").await.unwrap();
    let key = NewApiKey::generate();
    let key_id = store.add_key(account, &key).await.unwrap();
    store
        .grant(account, Bucket::Subscription, Credits(1 << 50))
        .await
        .unwrap();
    (
        Caller {
            account,
            key: key_id,
        },
        key,
    )
}

fn charge(caller: Caller) -> ChargeRequest<'static> {
    ChargeRequest {
        caller,
        protocol: Protocol::ChatCompletions,
        model: "gpt-4o-mini",
        price: Credits(2),
    }
}

fn ledger_benches<S: Store + 'static>(c: &mut Criterion, name: &str, store: Arc<S>) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (caller, _) = runtime.block_on(rich_caller(store.as_ref()));
    let failure = CallFailure {
        upstream_status: Some(500),
        error: "bench".into(),
    };
    c.bench_function(&format!("{name}/reserve+settle"), |b| {
        b.to_async(&runtime).iter(|| async {
            let reservation = store.reserve(charge(caller)).await.unwrap();
            assert!(
                store
                    .settle(reservation.call, CallSuccess::default())
                    .await
                    .unwrap()
            );
        })
    });
    c.bench_function(&format!("{name}/reserve+refund"), |b| {
        b.to_async(&runtime).iter(|| async {
            let reservation = store.reserve(charge(caller)).await.unwrap();
            assert!(store.refund(reservation.call, &failure).await.unwrap());
        })
    });
}

fn charging_path(c: &mut Criterion) {
    ledger_benches(c, "memory", Arc::new(MemoryStore::new()));
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("bench.db").display()
    );
    let sqlite = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(SeaOrmStore::connect(&url))
        .unwrap();
    ledger_benches(c, "sqlite-wal", Arc::new(sqlite));
}

fn stack_overhead(c: &mut Criterion) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let store = Arc::new(MemoryStore::new());
    let (_, key) = runtime.block_on(rich_caller(store.as_ref()));
    let body = Bytes::from_static(
        br#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Hello"}]}"#,
    );
    let stack = model_gateway::stack(
        store,
        Arc::new(Catalogue::demo()),
        model_gateway::DEFAULT_MAX_BODY_BYTES,
        MockUpstream::new(),
    );
    let bearer = format!("Bearer {}", key.reveal());
    c.bench_function("stack/four layers + mock, memory store", |b| {
        b.to_async(&runtime).iter(|| {
            let request = Request::post("/v1/chat/completions")
                .header("authorization", &bearer)
                .body(Full::new(body.clone()))
                .unwrap();
            let stack = stack.clone();
            async move {
                let response = stack.oneshot(request).await.unwrap();
                assert_eq!(response.status(), 200);
            }
        })
    });
    // The floor: the mock alone, given the extension the router would have added.
    let routed =
        model_gateway::route(&Catalogue::demo(), Protocol::ChatCompletions, &body).unwrap();
    let mut mock = MockUpstream::new();
    c.bench_function("stack/bare mock upstream", |b| {
        b.iter(|| {
            let mut request = Request::post("/v1/chat/completions")
                .body(body.clone())
                .unwrap();
            request.extensions_mut().insert(routed.clone());
            std::hint::black_box(mock.call(request).into_inner().unwrap());
        })
    });
}

criterion_group!(benches, charging_path, stack_overhead);
criterion_main!(benches);
