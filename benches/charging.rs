//! The charging path, and the stack's own cost.
//!
//! - `charging/<backend>/<op>/<accounts>/c<callers>`: reserve+settle or reserve+refund on the
//!   in-memory store, a `SQLite` file in WAL mode (shared, and owned by its store as the
//!   example gateway deploys it: `sqlite-owned`) and `PostgreSQL` (when
//!   `TEST_POSTGRES_URL` is set, in a schema of its own; with and without escrow, one and two
//!   instances); one hot account or 64 accounts; 1, 16
//!   and 64 concurrent callers. Throughput is printed as `elem/s` = charged calls per second.
//! - `stack/...`: one request through all four layers (in-memory store, mock upstream), on chat
//!   completions and on the Responses endpoint, against the bare mock upstream; and a streamed
//!   chat call read to its end (the billing reader reads each event).
//! - `responses/...`: the Responses translation's steps (the request read and translated, the
//!   chat request written, the chat reply translated back).
//!
//! `cargo bench --bench charging` (add `-- charging/sqlite` to filter).
//!
//! The benches allocate with jemalloc, as the example gateway and the load test do, so that
//! they measure what the binary runs (glibc's allocator took about a tenth of the stack
//! bench's time in a profile).

// Tests, benches and the load test unwrap (a panic is how they fail) and share helpers
// through `pub` items of their own modules.
#![allow(clippy::unwrap_used, unreachable_pub)]

use std::sync::Arc;
use std::time::{Duration, Instant};

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use http::Request;
use http_body_util::Full;
use model_gateway::{
    Catalogue, Credits, MemoryStore, Protocol, SeaOrmStore, Store, credits::Bucket,
    keys::NewApiKey, store::CallFailure, store::CallSuccess, store::Caller, store::ChargeRequest,
    store::Leases, upstream::MockUpstream,
};
use sea_orm::ConnectionTrait;
use tower::{Service, ServiceExt};

async fn rich_callers(store: &dyn Store, count: usize) -> Vec<Caller> {
    let mut callers = Vec::new();
    for _ in 0..count {
        let account = store.create_account("bench").await.unwrap();
        let key = store
            .add_key(account, &NewApiKey::generate())
            .await
            .unwrap();
        store
            .grant(account, Bucket::Subscription, Credits::new(1 << 50))
            .await
            .unwrap();
        callers.push(Caller { account, key });
    }
    callers
}

#[derive(Clone, Copy)]
enum Outcome {
    Settle,
    Refund,
}

/// One reserve followed by its settle or refund.
async fn charge_once(store: &dyn Store, caller: Caller, outcome: Outcome) {
    let request = ChargeRequest::new(
        caller,
        Protocol::ChatCompletions,
        "gpt-4o-mini",
        Credits::new(2),
    );
    let reservation = store.reserve(request).await.unwrap();
    let done = match outcome {
        Outcome::Settle => store.settle(reservation.call, CallSuccess::default()).await,
        Outcome::Refund => {
            let failure = CallFailure {
                upstream_status: Some(500),
                error: "bench".into(),
            };
            store.refund(reservation.call, &failure).await
        }
    };
    assert!(done.unwrap());
}

/// `total` charges spread over `callers` concurrent tasks, task `i` going through
/// `stores[i % stores.len()]` (several stores on one database stand for several gateway
/// instances); returns the elapsed time.
async fn charge_concurrently(
    stores: Arc<Vec<Arc<dyn Store>>>,
    accounts: Arc<Vec<Caller>>,
    outcome: Outcome,
    callers: usize,
    total: u64,
) -> Duration {
    let started = Instant::now();
    let tasks: Vec<_> = (0..callers)
        .map(|task| {
            let (store, accounts) = (stores[task % stores.len()].clone(), accounts.clone());
            let share = total / callers as u64 + u64::from((task as u64) < total % callers as u64);
            tokio::spawn(async move {
                for i in 0..share {
                    let caller = accounts[(task + i as usize) % accounts.len()];
                    charge_once(store.as_ref(), caller, outcome).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    started.elapsed()
}

fn bench_backend(
    c: &mut Criterion,
    runtime: &tokio::runtime::Runtime,
    name: &str,
    stores: Vec<Arc<dyn Store>>,
) {
    let stores = Arc::new(stores);
    let store = stores[0].clone();
    let mut group = c.benchmark_group(format!("charging/{name}"));
    group.throughput(Throughput::Elements(1));
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    for (label, accounts) in [("hot-account", 1), ("64-accounts", 64)] {
        let accounts = Arc::new(runtime.block_on(rich_callers(store.as_ref(), accounts)));
        for (op, outcome) in [
            ("reserve+settle", Outcome::Settle),
            ("reserve+refund", Outcome::Refund),
        ] {
            for callers in [1usize, 16, 64] {
                let id = BenchmarkId::new(format!("{op}/{label}"), format!("c{callers}"));
                group.bench_function(id, |b| {
                    b.to_async(runtime).iter_custom(|iters| {
                        charge_concurrently(
                            stores.clone(),
                            accounts.clone(),
                            outcome,
                            callers,
                            iters,
                        )
                    })
                });
            }
        }
    }
    group.finish();
}

fn charging_path(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    bench_backend(c, &runtime, "memory", vec![Arc::new(MemoryStore::new())]);

    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("bench.db").display()
    );
    let sqlite = runtime.block_on(SeaOrmStore::connect(&url)).unwrap();
    bench_backend(c, &runtime, "sqlite-wal", vec![Arc::new(sqlite)]);
    // The same, the file owned by its store: reservations held in memory, one write per call.
    let owned_url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("owned.db").display()
    );
    let owned = runtime
        .block_on(SeaOrmStore::connect(&owned_url))
        .unwrap()
        .own_file()
        .unwrap();
    bench_backend(c, &runtime, "sqlite-owned", vec![Arc::new(owned)]);

    match std::env::var("TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => {
            let schema = format!("mg_bench_{}", std::process::id());
            let connect = || async {
                let mut options = sea_orm::ConnectOptions::new(&url);
                options.set_schema_search_path(&schema).max_connections(32);
                Arc::new(SeaOrmStore::connect_with(options).await.unwrap()) as Arc<dyn Store>
            };
            let (one, two) = runtime.block_on(async {
                let admin = sea_orm::Database::connect(&url).await.unwrap();
                admin
                    .execute_unprepared(&format!(
                        "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
                    ))
                    .await
                    .unwrap();
                (connect().await, connect().await)
            });
            bench_backend(c, &runtime, "postgres", vec![one.clone()]);
            bench_backend(c, &runtime, "postgres-2-instances", vec![one, two]);
            // The same with escrow: each store holds a lease, as a serving gateway does.
            let escrowed = || async {
                let mut options = sea_orm::ConnectOptions::new(&url);
                options.set_schema_search_path(&schema).max_connections(32);
                let store = SeaOrmStore::connect_with(options)
                    .await
                    .unwrap()
                    .with_escrow()
                    .unwrap();
                store
                    .take_lease(chrono::Utc::now(), Duration::from_secs(3600))
                    .await
                    .unwrap();
                Arc::new(store) as Arc<dyn Store>
            };
            let (one, two) = runtime.block_on(async { (escrowed().await, escrowed().await) });
            bench_backend(c, &runtime, "postgres-escrow", vec![one.clone()]);
            bench_backend(c, &runtime, "postgres-escrow-2-instances", vec![one, two]);
            runtime.block_on(async {
                let admin = sea_orm::Database::connect(&url).await.unwrap();
                admin
                    .execute_unprepared(&format!("DROP SCHEMA {schema} CASCADE"))
                    .await
                    .unwrap();
            });
        }
        _ => eprintln!("TEST_POSTGRES_URL is not set: skipping the PostgreSQL charging benchmarks"),
    }
}

/// A call on `path` with `body`, by the key in `bearer`.
fn paid_request(path: &str, bearer: &str, body: &Bytes) -> Request<Full<Bytes>> {
    Request::post(path)
        .header("authorization", bearer)
        .body(Full::new(body.clone()))
        .unwrap()
}

/// An in-memory store with one funded caller, and that caller's key.
fn funded_store(runtime: &tokio::runtime::Runtime) -> (Arc<MemoryStore>, NewApiKey) {
    let store = Arc::new(MemoryStore::new());
    let key = runtime.block_on(async {
        let callers = rich_callers(store.as_ref(), 1).await;
        let key = NewApiKey::generate();
        model_gateway::Accounts::add_key(store.as_ref(), callers[0].account, &key)
            .await
            .unwrap();
        key
    });
    (store, key)
}

fn stack_overhead(c: &mut Criterion) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (store, key) = funded_store(&runtime);
    let body = Bytes::from_static(
        br#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Hello"}]}"#,
    );
    let stack = model_gateway::stack(
        store,
        Arc::new(Catalogue::demo()),
        model_gateway::router::DEFAULT_MAX_BODY_BYTES,
        MockUpstream::new(),
    );
    let bearer = format!("Bearer {}", key.reveal());
    // One paid call on `path`, answered 200.
    let mut bench_call = |name: &str, path: &'static str, body: &Bytes| {
        c.bench_function(name, |b| {
            b.to_async(&runtime).iter(|| {
                let request = paid_request(path, &bearer, body);
                let stack = stack.clone();
                async move {
                    let response = stack.oneshot(request).await.unwrap();
                    assert_eq!(response.status(), 200);
                }
            })
        });
    };
    bench_call(
        "stack/four layers + mock, memory store",
        "/v1/chat/completions",
        &body,
    );
    // The same question on the Responses endpoint (translated: the demo catalogue's upstreams
    // speak chat completions), to show what its translation adds to a call.
    let responses_body = Bytes::from_static(
        br#"{"model":"gpt-4o-mini","input":[{"role":"user","content":"Hello"}]}"#,
    );
    bench_call(
        "stack/four layers + mock, memory store, responses",
        "/v1/responses",
        &responses_body,
    );
    // The floor: the mock alone, given the extension the router would have added.
    let routed =
        model_gateway::router::route(&Catalogue::demo(), Protocol::ChatCompletions, &body, false)
            .unwrap();
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

/// A streamed chat call through the four layers, streaming on: the mock's events, each read
/// once by the billing reader on its way to the client, and the call settled at `[DONE]`.
fn stack_stream(c: &mut Criterion) {
    use http_body_util::BodyExt;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (store, key) = funded_store(&runtime);
    let stack = model_gateway::stack(
        store,
        Arc::new(Catalogue::demo().with_streaming(true)),
        model_gateway::router::DEFAULT_MAX_BODY_BYTES,
        MockUpstream::new(),
    );
    let bearer = format!("Bearer {}", key.reveal());
    let body = Bytes::from_static(
        br#"{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"Hello"}]}"#,
    );
    c.bench_function("stack/four layers + mock, memory store, chat stream", |b| {
        b.to_async(&runtime).iter(|| {
            let request = paid_request("/v1/chat/completions", &bearer, &body);
            let stack = stack.clone();
            async move {
                let response = stack.oneshot(request).await.unwrap();
                assert_eq!(response.status(), 200);
                let events = response.into_body().collect().await.unwrap().to_bytes();
                assert!(events.ends_with(b"data: [DONE]\n\n"));
            }
        })
    });
}

/// The Responses translation's own steps, on the load test's question and provider reply.
fn responses_translation(c: &mut Criterion) {
    use model_gateway::protocol::responses::{
        Ids, StreamTranslator, Translated, response_json_from_chat_bytes,
    };
    let body: &[u8] =
        br#"{"model":"gpt-4o-mini","input":[{"role":"user","content":"Hello, how are you today?"}]}"#;
    let reply: &[u8] = br#"{"id":"chatcmpl-load","object":"chat.completion","created":1741476542,"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"This is a fixed reply from the load test's provider."},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":11,"total_tokens":23}}"#;
    c.bench_function("responses/request read and translated", |b| {
        b.iter(|| std::hint::black_box(Translated::from_slice(body).unwrap()))
    });
    // A coding agent's turn: long instructions, a dozen function tools, and the conversation so
    // far (its messages, calls, their outputs and its reasoning), sent whole on every turn.
    // Then the same with `apply_patch` as a custom tool and half the calls its, as the CLI
    // sends them under its own model names.
    for (name, custom) in [("", false), (" with custom apply_patch", true)] {
        let agent = coding_agent_request(custom);
        c.bench_function(
            &format!("responses/coding agent's request{name} read and translated"),
            |b| b.iter(|| std::hint::black_box(Translated::from_slice(&agent).unwrap())),
        );
        // The same through a `serde_json::Value`, as requests out of the ordinary are read.
        c.bench_function(
            &format!("responses/coding agent's request{name} parsed and translated"),
            |b| {
                b.iter(|| {
                    let request: serde_json::Value = serde_json::from_slice(&agent).unwrap();
                    std::hint::black_box(Translated::new(request).unwrap())
                })
            },
        );
    }
    let translated = Translated::from_slice(body).unwrap();
    c.bench_function("responses/chat request written", |b| {
        b.iter(|| std::hint::black_box(translated.chat_body("gpt-4o-mini")))
    });
    // What a chat call does with the same reply, against which the translation's cost shows.
    c.bench_function("responses/chat reply's usage read (the chat path)", |b| {
        b.iter(|| std::hint::black_box(model_gateway::protocol::reply_usage(reply)))
    });
    // A streamed reply: the role, eight text deltas, the finish, the usage and `[DONE]`, as one
    // provider's chunks, translated into the Responses events a client reads.
    let mut chat_stream = String::new();
    let chunk = |delta: &str, finish: &str| {
        format!(
            "data: {{\"id\":\"chatcmpl-load\",\"object\":\"chat.completion.chunk\",\"created\":1741476542,\"model\":\"gpt-4o-mini\",\"choices\":[{{\"index\":0,\"delta\":{{{delta}}},\"finish_reason\":{finish}}}]}}\n\n"
        )
    };
    chat_stream.push_str(&chunk(r#""role":"assistant","content":"""#, "null"));
    for word in [
        "This ",
        "is ",
        "a ",
        "fixed ",
        "reply ",
        "from ",
        "the ",
        "provider.",
    ] {
        chat_stream.push_str(&chunk(&format!(r#""content":"{word}""#), "null"));
    }
    chat_stream.push_str(&chunk("", r#""stop""#));
    chat_stream.push_str(concat!(
        r#"data: {"id":"chatcmpl-load","object":"chat.completion.chunk","created":1741476542,"#,
        r#""model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":8,"#,
        "\"total_tokens\":20}}\n\ndata: [DONE]\n\n"
    ));
    c.bench_function("responses/chat stream translated (10 chunks)", |b| {
        b.iter(|| {
            let mut translator = StreamTranslator::new(&translated, Ids::random());
            let events = translator.push(chat_stream.as_bytes());
            assert!(translator.ended());
            std::hint::black_box(events)
        })
    });
    c.bench_function("responses/chat reply translated, usage read", |b| {
        b.iter(|| {
            std::hint::black_box(
                response_json_from_chat_bytes(&translated, reply, &mut Ids::random()).unwrap(),
            )
        })
    });
}

/// A coding agent's request in the middle of a task, about 60 KB: the shape `OpenAI`'s
/// coding-agent CLI sends (instructions, function tools, `input` items of every kind); with
/// `custom`, its `apply_patch` a custom tool under a Lark grammar, called on every other turn.
fn coding_agent_request(custom: bool) -> Vec<u8> {
    use serde_json::json;
    let prose = "Keep the change small, run the tests, and explain what you did. ".repeat(120);
    let mut tools: Vec<_> = (0..12)
        .map(|n| {
            json!({ "type": "function", "name": format!("tool_{n}"), "strict": false,
                    "description": "Runs a command in the workspace and returns its output.",
                    "parameters": { "type": "object", "required": ["command"],
                        "properties": { "command": { "type": "array", "items": { "type": "string" } },
                                        "workdir": { "type": "string" },
                                        "timeout_ms": { "type": "number" } } } })
        })
        .collect();
    if custom {
        let grammar =
            "start: begin_patch hunk+ end_patch\nbegin_patch: \"*** Begin Patch\" LF\n".repeat(20);
        tools.push(json!({ "type": "custom", "name": "apply_patch",
                           "description": "Edits files with a patch.",
                           "format": { "type": "grammar", "syntax": "lark", "definition": grammar } }));
    }
    let output = "test result: ok. 42 passed; 0 failed\n".repeat(30);
    let mut input = vec![json!({ "type": "message", "role": "user",
                                 "content": [{ "type": "input_text", "text": "Fix the failing test." }] })];
    for turn in 0..10 {
        let call_id = format!("call_{turn}");
        input.push(
            json!({ "type": "reasoning", "id": format!("rs_{turn}"), "summary": [],
                           "encrypted_content": "gAAAAB".repeat(200) }),
        );
        if custom && turn % 2 == 1 {
            let patch = "*** Begin Patch\n*** Update File: src/lib.rs\n-old\n+new\n*** End Patch\n";
            input.push(json!({ "type": "custom_tool_call", "name": "apply_patch",
                               "call_id": call_id, "input": patch.repeat(10) }));
            input.push(
                json!({ "type": "custom_tool_call_output", "call_id": call_id,
                               "output": "Success. Updated the following files:\nM src/lib.rs\n" }),
            );
        } else {
            input.push(
                json!({ "type": "function_call", "name": "tool_0", "call_id": call_id,
                               "arguments": "{\"command\":[\"cargo\",\"test\"]}" }),
            );
            input.push(
                json!({ "type": "function_call_output", "call_id": call_id, "output": output }),
            );
        }
        input.push(json!({ "type": "message", "role": "assistant",
                           "content": [{ "type": "output_text", "text": "The tests pass now." }] }));
    }
    serde_json::to_vec(&json!({
        "model": "gpt-4o-mini", "instructions": prose, "input": input, "tools": tools,
        "tool_choice": "auto", "parallel_tool_calls": false, "reasoning": { "effort": "medium" },
        "store": false, "stream": true, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "session-1",
    }))
    .unwrap()
}

/// A token-priced call's input ceiling (`pricing::input_ceiling_tokens`): a one-line chat
/// request, and a coding agent's 60 KB turn, which names files in its text and so is scanned
/// for media parts whole.
fn input_ceiling(c: &mut Criterion) {
    use model_gateway::pricing::input_ceiling_tokens;
    let chat: &[u8] = br#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Hello, how are you today?"}]}"#;
    c.bench_function("pricing/input ceiling of a one-line chat request", |b| {
        b.iter(|| std::hint::black_box(input_ceiling_tokens(std::hint::black_box(chat))))
    });
    let agent = coding_agent_request(false);
    c.bench_function("pricing/input ceiling of a coding agent's request", |b| {
        b.iter(|| std::hint::black_box(input_ceiling_tokens(std::hint::black_box(&agent))))
    });
}

criterion_group!(
    benches,
    charging_path,
    stack_overhead,
    stack_stream,
    responses_translation,
    input_ceiling
);
criterion_main!(benches);
