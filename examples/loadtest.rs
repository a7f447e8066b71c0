//! End-to-end load test, in one run, on this machine:
//!
//! 1. the floor: an axum server that parses the body and returns the same mock reply, with
//!    none of our layers;
//! 2. the durable floor: the floor, but each request's reply waits until a record of a call-log
//!    entry's size is on disk, written and `fdatasync`ed in batches by one thread (what any
//!    gateway that puts a call on disk before answering pays at the least);
//! 3. the full example gateway (all four layers, behind `model_gateway::server` as the example
//!    serves them) in mock mode on the in-memory store: what HTTP and the layers cost without a
//!    database; then the same with each reply waiting for such a record (the most a gateway
//!    with a durable ledger could reach here);
//! 4. the same on a `SQLite` file (WAL), shared and owned;
//! 5. the same on `PostgreSQL`, when `TEST_POSTGRES_URL` is set (a schema of its own);
//!
//! each driven with the same HTTP load (keep-alive connections, one hot account) at
//! concurrency 1, 16 and 64. Prints requests per second, p50 and p99 latency, each gateway's
//! throughput as a share of the floor's, the CPU time the whole process (load generator
//! included) spent per request, and for the database gateways how many ledger writes each
//! transaction and each flush carried; then checks that every 200 answer has an `ok`
//! call-log entry. Then it starts the release gateway binary, holds 1000 client connections
//! open against it and prints its resident memory.
//!
//! Last, streaming: a fake provider in this process streams `LOADTEST_STREAM_EVENTS` (200)
//! events, one every `LOADTEST_STREAM_GAP_MS` (10), each stamped with when it was sent;
//! `LOADTEST_STREAMS` (1000) clients read such streams at once, first from the provider directly,
//! then through a bare proxy (this binary run again as a process of its own: the gateway's HTTP
//! server and a reqwest client passing bytes on unread, the streaming floor), then through the
//! release gateway binary (`SQLite`, streaming on, every stream billed). It prints events per
//! second, each event's latency from provider to client (p50, p99) and what the bare proxy and
//! the gateway add to it, the CPU each spends per event, the time to the first event, the
//! gateway's resident memory while the streams are open, and checks that every stream was
//! billed `ok`. `LOADTEST_ONLY=streams` runs only this part, `LOADTEST_ONLY=requests` all but
//! this part.
//!
//! ```text
//! cargo build --release --example gateway && cargo run --release --example loadtest
//! ```
//! `LOADTEST_REQUESTS` (default 10000) sets the requests per run at concurrency 16 and 64; a
//! fifth of that runs at concurrency 1. `LOADTEST_CONCURRENCY` runs one level instead of all
//! three; `LOADTEST_ROUNDS` repeats each level that many times and prints the medians.
//! `LOADTEST_IDEMPOTENCY_KEYS=1` sends every request with an `Idempotency-Key` of its own, so
//! every call takes the keyed path (its record written with the reservation, its reply with the
//! settle).

// Tests, benches and the load test unwrap (a panic is how they fail) and share helpers
// through `pub` items of their own modules.
#![allow(clippy::unwrap_used, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use model_gateway::{
    Accounts, Catalogue, Credits, MemoryStore, Protocol, SeaOrmStore, Upstream, credits::Bucket,
    keys::NewApiKey, router::DEFAULT_MAX_BODY_BYTES, store::GroupCommitStats,
    upstream::MockUpstream,
};
use sea_orm::{ConnectionTrait, Statement};
use tower::Service;

const CONCURRENCY: [usize; 3] = [1, 16, 64];
const BODY: &str =
    r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Hello, how are you today?"}]}"#;

struct Target {
    name: &'static str,
    base: String,
    key: Option<String>,
    store: Option<Arc<SeaOrmStore>>,
}

#[derive(Clone, Copy)]
struct Figures {
    rps: f64,
    p50: Duration,
    p99: Duration,
    ok: u64,
    /// CPU time of the whole process (load generator included) per request, where the OS says.
    cpu_per_request: Option<Duration>,
}

/// CPU time this process has used so far (user + system), from `/proc/self/stat` on Linux.
fn process_cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // Linux reports these in USER_HZ, which is 100 on every architecture it supports.
    Some(Duration::from_millis(ticks * 10))
}

async fn serve(router: axum::Router) -> String {
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
    mut mock: MockUpstream,
    body: Bytes,
) -> http::Response<axum::body::Body> {
    let routed =
        model_gateway::router::route(catalogue, Protocol::ChatCompletions, &body, false).unwrap();
    let mut request = http::Request::new(body);
    request.extensions_mut().insert(routed);
    let reply = mock.call(request).into_inner().unwrap();
    reply.map(|body| axum::body::Body::from(body.as_complete().cloned().unwrap_or_default()))
}

/// What a journal record holds: about a call-log entry's size.
const RECORD: usize = 200;
/// A journal's file, written over and over from the start.
const JOURNAL_FILE: u64 = 64 << 20;

/// Records waiting to be written, and the sequence number of the last one queued.
#[derive(Default)]
struct Queued {
    records: std::sync::Mutex<(Vec<u8>, u64)>,
    wake: std::sync::Condvar,
}

/// The least a call can pay to be on disk before its reply: one thread writes whatever records
/// were queued meanwhile to a file written in full beforehand (so that no write changes its
/// size or its blocks) and `fdatasync`s it, then wakes those records' callers; one write and
/// one flush per batch, as the gateway's flusher does, and nothing else.
#[derive(Clone)]
struct Journal {
    queued: Arc<Queued>,
    on_disk: tokio::sync::watch::Receiver<u64>,
}

impl Journal {
    fn create(path: &std::path::Path) -> Journal {
        let file = std::fs::File::create(path).unwrap();
        std::io::Write::write_all(&mut &file, &vec![0; JOURNAL_FILE as usize]).unwrap();
        file.sync_all().unwrap();
        let queued = Arc::new(Queued::default());
        let (durable, on_disk) = tokio::sync::watch::channel(0u64);
        let writer = queued.clone();
        std::thread::spawn(move || {
            use std::os::unix::fs::FileExt;
            let (mut offset, mut batch) = (0, Vec::new());
            loop {
                let last = {
                    let mut queued = writer.records.lock().unwrap();
                    while queued.0.is_empty() {
                        queued = writer.wake.wait(queued).unwrap();
                    }
                    std::mem::swap(&mut batch, &mut queued.0);
                    queued.1
                };
                if offset + batch.len() as u64 > JOURNAL_FILE {
                    offset = 0;
                }
                file.write_all_at(&batch, offset).unwrap();
                file.sync_data().unwrap();
                offset += batch.len() as u64;
                batch.clear();
                if durable.send(last).is_err() {
                    return;
                }
            }
        });
        Journal { queued, on_disk }
    }

    /// Queues a record and waits until it is on disk.
    async fn record(&self) {
        let sequence = {
            let mut queued = self.queued.records.lock().unwrap();
            queued.0.extend_from_slice(&[b'x'; RECORD]);
            queued.1 += 1;
            queued.1
        };
        self.queued.wake.notify_one();
        self.on_disk
            .clone()
            .wait_for(|durable| *durable >= sequence)
            .await
            .unwrap();
    }
}

/// The floor: parse the body as the gateway does, answer the mock reply, nothing else. With a
/// journal, the durable floor: each reply waits for a [`Journal`] record; no gateway that puts
/// each call on disk before answering can beat it on this machine.
async fn floor(journal: Option<Journal>) -> Target {
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

/// The full gateway on the in-memory store. It keeps no call log to check afterwards. With a
/// journal, each reply waits for a record of it (the in-memory gateway made durable at the
/// least cost: what the best ledger on this machine's disk could reach).
async fn memory_gateway(journal: Option<Journal>) -> Target {
    let store = Arc::new(MemoryStore::new());
    let account = store.create_account("load").await.unwrap();
    let key = NewApiKey::generate();
    store.add_key(account, &key).await.unwrap();
    store
        .grant(account, Bucket::Subscription, Credits::new(1 << 50))
        .await
        .unwrap();
    let router = model_gateway::Gateway::new(
        store,
        Arc::new(Catalogue::demo()),
        Upstream::Mock(MockUpstream::new()),
    )
    .body_limits(DEFAULT_MAX_BODY_BYTES)
    .router();
    let (name, router) = match journal {
        None => ("gateway, in-memory", router),
        Some(journal) => (
            "gateway, in-memory+journal",
            router.layer(axum::middleware::from_fn(
                move |request: axum::extract::Request, next: axum::middleware::Next| {
                    let journal = journal.clone();
                    async move {
                        let reply = next.run(request).await;
                        journal.record().await;
                        reply
                    }
                },
            )),
        ),
    };
    Target {
        name,
        base: serve_gateway(router).await,
        key: Some(key.reveal().to_owned()),
        store: None,
    }
}

async fn gateway(name: &'static str, store: SeaOrmStore) -> Target {
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
    let router = model_gateway::Gateway::new(
        store.clone(),
        Arc::new(Catalogue::demo()),
        Upstream::Mock(MockUpstream::new()),
    )
    .body_limits(DEFAULT_MAX_BODY_BYTES)
    .router();
    Target {
        name,
        base: serve_gateway(router).await,
        key: Some(key),
        store: Some(store),
    }
}

/// `requests` calls over `concurrency` keep-alive connections.
async fn drive(target: &Target, concurrency: usize, requests: u64) -> Figures {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()
        .unwrap();
    let url = format!("{}/v1/chat/completions", target.base);
    let keyed = std::env::var("LOADTEST_IDEMPOTENCY_KEYS").as_deref() == Ok("1");
    let run = fastrand::u64(..);
    let issued = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let cpu_before = process_cpu_time();
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (client, url, key) = (client.clone(), url.clone(), target.key.clone());
            let (issued, ok) = (issued.clone(), ok.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                loop {
                    let n = issued.fetch_add(1, Ordering::Relaxed);
                    if n >= requests {
                        break;
                    }
                    let mut request = client
                        .post(&url)
                        .header("content-type", "application/json")
                        .body(BODY);
                    if keyed {
                        request = request.header("idempotency-key", format!("lt-{run}-{n}"));
                    }
                    if let Some(key) = &key {
                        request = request.bearer_auth(key);
                    }
                    let sent = Instant::now();
                    let response = request.send().await.unwrap();
                    let status = response.status();
                    response.bytes().await.unwrap();
                    latencies.push(sent.elapsed());
                    if status == 200 {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(requests as usize);
    for worker in workers {
        latencies.extend(worker.await.unwrap());
    }
    let elapsed = started.elapsed();
    let cpu_per_request = cpu_before
        .zip(process_cpu_time())
        .map(|(before, after)| (after - before) / requests as u32);
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    Figures {
        rps: latencies.len() as f64 / elapsed.as_secs_f64(),
        p50: at(0.50),
        p99: at(0.99),
        ok: ok.load(Ordering::Relaxed),
        cpu_per_request,
    }
}

async fn ok_entries(store: &SeaOrmStore) -> u64 {
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

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

/// A free port on the loopback address.
fn free_address() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string()
}

/// Waits until something accepts connections at `address` (a process started by the test).
async fn listening(address: &str) {
    while std::net::TcpStream::connect(address).is_err() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Starts the release gateway binary, opens 1000 keep-alive connections that each made one
/// call, and reads the process's resident memory.
async fn resident_memory_with_1000_connections() -> Option<(u64, u64)> {
    let binary = std::env::current_exe().ok()?.with_file_name("gateway");
    if !binary.exists() {
        eprintln!("{} not built; skipping the memory check", binary.display());
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let listen = free_address();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("rss.db").display());
    let env = |command: &mut std::process::Command| {
        command
            .env("DATABASE_URL", &url)
            .env("GATEWAY_LISTEN", &listen)
            .env("MOCK_UPSTREAM", "1")
            .env("RUST_LOG", "warn");
    };
    let mut create = std::process::Command::new(&binary);
    create.args(["keys", "create", "--subscription", "100000"]);
    env(&mut create);
    let output = create.output().unwrap();
    let key = String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .last()
        .unwrap()
        .to_owned();
    let mut serve = std::process::Command::new(&binary);
    serve.arg("serve").stdout(std::process::Stdio::null());
    env(&mut serve);
    let mut child = serve.spawn().unwrap();
    listening(&listen).await;
    let rss = || streaming::resident_kib(child.id());
    let idle = rss();
    let mut connections = Vec::new();
    for _ in 0..1000 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(&listen).await.unwrap();
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{BODY}",
            BODY.len()
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut buffer = [0u8; 2048];
        let read = stream.read(&mut buffer).await.unwrap();
        assert!(buffer[..read].starts_with(b"HTTP/1.1 200"));
        connections.push(stream); // kept open (keep-alive)
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let loaded = rss();
    drop(connections);
    child.kill().ok();
    child.wait().ok();
    Some((idle, loaded))
}

fn print_figures(target: &Target, concurrency: usize, figures: &Figures, floor: &Figures) {
    println!(
        "{:<22} {:>4} {:>10.0} {:>9.3} {:>9.3} {:>11.2}x {:>+13.3} {:>11}",
        target.name,
        concurrency,
        figures.rps,
        ms(figures.p50),
        ms(figures.p99),
        figures.rps / floor.rps,
        ms(figures.p99) - ms(floor.p99),
        figures
            .cpu_per_request
            .map_or("n/a".to_owned(), |cpu| format!(
                "{:.0}",
                cpu.as_secs_f64() * 1e6
            )),
    );
}

/// How many ledger writes each transaction and each flush carried between two readings.
fn print_ledger(before: GroupCommitStats, after: GroupCommitStats) {
    let writes = after.writes - before.writes;
    let per = |count: u64| writes as f64 / count.max(1) as f64;
    println!(
        "{:<27} ledger: {writes} writes, {:.1} per transaction, {:.1} per flush",
        "",
        per(after.transactions - before.transactions),
        per(after.flushes - before.flushes),
    );
}

/// The gateway binary's allocator (see `examples/gateway/main.rs`), so that the gateways run in
/// this process measure what the binary runs; the floor and the load generator share it.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() {
    if let Ok(upstream) = std::env::var(streaming::PROXY_UPSTREAM) {
        streaming::bare_proxy(upstream).await;
        return;
    }
    if std::env::var("LOADTEST_ONLY").as_deref() == Ok("streams") {
        streaming::run().await;
        return;
    }
    let requests: u64 = std::env::var("LOADTEST_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let dir = tempfile::tempdir().unwrap();
    let sqlite_url = format!("sqlite://{}?mode=rwc", dir.path().join("load.db").display());
    let owned_url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("owned.db").display()
    );
    let mut targets = vec![
        floor(None).await,
        floor(Some(Journal::create(&dir.path().join("floor.journal")))).await,
        memory_gateway(None).await,
        memory_gateway(Some(Journal::create(&dir.path().join("gateway.journal")))).await,
        gateway(
            "gateway, SQLite",
            SeaOrmStore::connect(&sqlite_url).await.unwrap(),
        )
        .await,
        // The same, with the file owned: reservations held in memory, one write per call.
        gateway(
            "gateway, SQLite owned",
            SeaOrmStore::connect(&owned_url)
                .await
                .unwrap()
                .own_file()
                .unwrap(),
        )
        .await,
    ];
    let postgres = std::env::var("TEST_POSTGRES_URL")
        .ok()
        .filter(|url| !url.is_empty());
    let schema = format!("mg_loadtest_{}", std::process::id());
    if let Some(url) = &postgres {
        let admin = sea_orm::Database::connect(url).await.unwrap();
        admin
            .execute_unprepared(&format!(
                "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
            ))
            .await
            .unwrap();
        let mut options = sea_orm::ConnectOptions::new(url);
        options.set_schema_search_path(&schema).max_connections(32);
        targets.push(
            gateway(
                "gateway, PostgreSQL",
                SeaOrmStore::connect_with(options).await.unwrap(),
            )
            .await,
        );
    } else {
        eprintln!("TEST_POSTGRES_URL is not set: skipping the PostgreSQL gateway");
    }

    // `LOADTEST_TARGETS=owned,in-memory` keeps the floor and the targets whose names contain
    // one of those words (to profile one of them, say).
    if let Ok(only) = std::env::var("LOADTEST_TARGETS") {
        let words: Vec<&str> = only.split(',').map(str::trim).collect();
        targets.retain(|target| {
            target.name.starts_with("floor") || words.iter().any(|word| target.name.contains(word))
        });
    }
    println!(
        "machine: {} cores; {} requests per run at c16/c64, {} at c1",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        requests,
        requests / 5
    );
    println!(
        "{:<22} {:>4} {:>10} {:>9} {:>9} {:>12} {:>14} {:>11}",
        "target", "c", "req/s", "p50 ms", "p99 ms", "vs floor", "p99 - floor", "CPU us/req"
    );
    let mut answered = vec![0u64; targets.len()];
    // `LOADTEST_CONCURRENCY=16` runs one level only (to profile it, say).
    let levels: Vec<usize> = match std::env::var("LOADTEST_CONCURRENCY") {
        Ok(level) => vec![level.parse().expect("LOADTEST_CONCURRENCY is a number")],
        Err(_) => CONCURRENCY.to_vec(),
    };
    // `LOADTEST_ROUNDS=5` repeats each level's targets, one after the other, and prints the
    // median of each gateway's figures against the floor of the same round: on a noisy machine
    // one round can be off by a factor of two.
    let rounds: usize = std::env::var("LOADTEST_ROUNDS")
        .map(|rounds| rounds.parse().expect("LOADTEST_ROUNDS is a number"))
        .unwrap_or(1);
    for concurrency in levels {
        let count = if concurrency == 1 {
            requests / 5
        } else {
            requests
        };
        // Per target, each round's (throughput / floor's, p99 - floor's p99 in ms).
        let mut against_floor = vec![Vec::new(); targets.len()];
        for _ in 0..rounds {
            let mut floor_figures: Option<Figures> = None;
            for (index, target) in targets.iter().enumerate() {
                drive(target, concurrency, 200).await; // warm-up
                answered[index] += 200;
                let before = target
                    .store
                    .as_ref()
                    .map(|store| store.group_commit_stats());
                let figures = drive(target, concurrency, count).await;
                answered[index] += count;
                assert_eq!(
                    figures.ok, count,
                    "{}: not every call answered 200",
                    target.name
                );
                let floor = *floor_figures.get_or_insert(figures);
                against_floor[index]
                    .push((figures.rps / floor.rps, ms(figures.p99) - ms(floor.p99)));
                print_figures(target, concurrency, &figures, &floor);
                if let (Some(store), Some(before)) = (&target.store, before) {
                    print_ledger(before, store.group_commit_stats());
                }
            }
        }
        if rounds > 1 {
            for (target, rounds) in targets.iter().zip(&against_floor).skip(1) {
                let median = |pick: fn(&(f64, f64)) -> f64| {
                    let mut values: Vec<f64> = rounds.iter().map(pick).collect();
                    values.sort_by(f64::total_cmp);
                    values[values.len() / 2]
                };
                println!(
                    "{:<22} {:>4} median of {} rounds: {:.2}x the floor, p99 {:+.3} ms above it",
                    target.name,
                    concurrency,
                    rounds.len(),
                    median(|round| round.0),
                    median(|round| round.1),
                );
            }
        }
    }
    for (target, answered) in targets.iter().zip(&answered) {
        if let Some(store) = &target.store {
            let ok = ok_entries(store).await;
            println!(
                "{}: {answered} answers of 200, {ok} ok call-log entries: {}",
                target.name,
                if ok == *answered { "match" } else { "MISMATCH" }
            );
            assert_eq!(ok, *answered);
        }
    }
    if let Some(url) = &postgres {
        let admin = sea_orm::Database::connect(url).await.unwrap();
        admin
            .execute_unprepared(&format!("DROP SCHEMA {schema} CASCADE"))
            .await
            .unwrap();
    }
    if let Some((idle, loaded)) = resident_memory_with_1000_connections().await {
        println!(
            "gateway process resident memory: {:.1} MiB idle, {:.1} MiB with 1000 open client connections",
            idle as f64 / 1024.0,
            loaded as f64 / 1024.0
        );
    }
    if std::env::var("LOADTEST_ONLY").as_deref() != Ok("requests") {
        streaming::run().await;
    }
}

mod streaming {
    //! The streaming part of the load test (see the crate docs).

    use std::sync::OnceLock;
    use std::time::{Duration, Instant};

    use axum::body::Bytes;

    /// Streams read one at a time to measure the time to the first event alone.
    const FIRST_EVENT_ROUNDS: u64 = 200;

    /// The instant event stamps count from: the provider and the clients share this process.
    static EPOCH: OnceLock<Instant> = OnceLock::new();

    fn micros_since_epoch() -> u64 {
        EPOCH.get_or_init(Instant::now).elapsed().as_micros() as u64
    }

    fn setting(name: &str, default: u64) -> u64 {
        std::env::var(name)
            .ok()
            .and_then(|value| value.parse().ok())
            .unwrap_or(default)
    }

    /// A provider whose every answer is an `OpenAI` event stream of stamped chunks (as many as
    /// the request's `max_tokens`), one every `gap`, then `[DONE]`.
    async fn provider(gap: Duration) -> String {
        let handler = move |body: Bytes| async move {
            let request: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let events = request["max_tokens"].as_u64().unwrap();
            let stream = futures::stream::unfold(0u64, move |sent| async move {
                if sent > events {
                    return None;
                }
                if sent > 0 {
                    tokio::time::sleep(gap).await;
                }
                let event = if sent == events {
                    "data: [DONE]\n\n".to_owned()
                } else {
                    format!(
                        "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok\"}}}}],\"t\":{}}}\n\n",
                        micros_since_epoch()
                    )
                };
                Some((
                    Ok::<_, std::convert::Infallible>(Bytes::from(event)),
                    sent + 1,
                ))
            });
            axum::response::Response::builder()
                .header("content-type", "text/event-stream")
                .body(axum::body::Body::from_stream(stream))
                .unwrap()
        };
        let router =
            axum::Router::new().route("/v1/chat/completions", axum::routing::post(handler));
        super::serve(router).await
    }

    /// Set in the environment of this binary when it runs as the bare proxy: the provider's
    /// base URL (see [`bare_proxy`]).
    pub(super) const PROXY_UPSTREAM: &str = "LOADTEST_PROXY_UPSTREAM";
    /// Where the bare proxy listens.
    const PROXY_LISTEN: &str = "LOADTEST_PROXY_LISTEN";

    /// The streaming floor: a proxy on the gateway's own server (`model_gateway::server`) and
    /// a reqwest client, as the gateway has, that forwards each request to `upstream` and
    /// passes the reply's bytes on as they arrive, reading none of them: no key, no ledger, no
    /// event parsing. What it adds to each event is what any proxy built of these parts adds
    /// on this machine. Runs until killed.
    pub(super) async fn bare_proxy(upstream: String) {
        let client = reqwest::Client::new();
        let url = format!("{upstream}/v1/chat/completions");
        let handler = move |body: Bytes| {
            let (client, url) = (client.clone(), url.clone());
            async move {
                let reply = client
                    .post(url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                http::Response::<reqwest::Body>::from(reply).map(axum::body::Body::new)
            }
        };
        let router =
            axum::Router::new().route("/v1/chat/completions", axum::routing::post(handler));
        let listener = model_gateway::server::bind(
            std::env::var(PROXY_LISTEN).unwrap(),
            model_gateway::server::DEFAULT_LISTEN_BACKLOG,
        )
        .await
        .unwrap();
        let limits = model_gateway::server::ServerLimits::default();
        model_gateway::server::serve(listener, router, limits, std::future::pending())
            .await
            .unwrap();
    }

    /// `streams` clients read streams through `address` (its process is `pid`); returns what
    /// they measured and the CPU time the process spent meanwhile, in nanoseconds: in all, and
    /// in user space (its own code, without the kernel's TCP work).
    async fn drive_through(
        address: &str,
        pid: u32,
        key: &str,
        streams: u64,
        events: u64,
    ) -> (Run, u64, u64) {
        let (cpu_before, user_before) = (cpu_nanos(pid), user_nanos(pid));
        let run = drive(
            &format!("http://{address}/v1/chat/completions"),
            key,
            streams,
            events,
        )
        .await;
        let cpu = cpu_nanos(pid).saturating_sub(cpu_before);
        (run, cpu, user_nanos(pid).saturating_sub(user_before))
    }

    /// What one side of the comparison measured.
    struct Run {
        events: u64,
        elapsed: Duration,
        /// Each event's latency from the provider's stamp to the client, in microseconds.
        latencies: Vec<u64>,
        /// Each stream's time from sending the request to its first event, in microseconds.
        first_events: Vec<u64>,
    }

    fn percentile(values: &mut [u64], share: f64) -> u64 {
        values.sort_unstable();
        values[((values.len() as f64 * share) as usize).min(values.len() - 1)]
    }

    /// `streams` clients at once, each reading one stream from `url` to its end.
    async fn drive(url: &str, key: &str, streams: u64, events: u64) -> Run {
        let client = reqwest::Client::new();
        let body = format!(
            r#"{{"model":"gpt-4o-mini","stream":true,"max_tokens":{events},"messages":[{{"role":"user","content":"Hi"}}]}}"#
        );
        let started = Instant::now();
        let tasks: Vec<_> = (0..streams)
            .map(|_| {
                let (client, url, key) = (client.clone(), url.to_owned(), key.to_owned());
                let body = body.clone();
                tokio::spawn(async move {
                    let sent = Instant::now();
                    let mut response = client
                        .post(url)
                        .bearer_auth(key)
                        .header("content-type", "application/json")
                        .body(body)
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(response.status(), 200);
                    let mut latencies = Vec::with_capacity(events as usize);
                    let mut first_event = None;
                    let mut pending = Vec::new();
                    while let Some(chunk) = response.chunk().await.unwrap() {
                        let now = micros_since_epoch();
                        first_event.get_or_insert_with(|| sent.elapsed().as_micros() as u64);
                        pending.extend_from_slice(&chunk);
                        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
                            let event: Vec<u8> = pending.drain(..end + 2).collect();
                            let text = std::str::from_utf8(&event).unwrap();
                            if let Some(stamp) = text.rsplit_once("\"t\":") {
                                let stamp: u64 =
                                    stamp.1.trim_end_matches(['}', '\n']).parse().unwrap();
                                latencies.push(now.saturating_sub(stamp));
                            }
                        }
                    }
                    assert_eq!(latencies.len() as u64, events, "a stream ended early");
                    (latencies, first_event.unwrap())
                })
            })
            .collect();
        let mut run = Run {
            events: 0,
            elapsed: Duration::ZERO,
            latencies: Vec::new(),
            first_events: Vec::new(),
        };
        for task in tasks {
            let (latencies, first) = task.await.unwrap();
            run.events += latencies.len() as u64;
            run.latencies.extend(latencies);
            run.first_events.push(first);
        }
        run.elapsed = started.elapsed();
        run
    }

    /// Resident memory of process `pid`, in KiB, from `/proc`.
    pub(super) fn resident_kib(pid: u32) -> u64 {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_default()
            .lines()
            .find(|line| line.starts_with("VmRSS:"))
            .and_then(|line| line.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(0)
    }

    /// User-space CPU time the process `pid` has used so far, in nanoseconds, at the 10 ms
    /// resolution of `/proc/PID/stat` (`utime`, in clock ticks of 1/100 s).
    fn user_nanos(pid: u32) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The fields after the command name, which is in parentheses and may hold spaces.
        let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let ticks: u64 = after_name
            .split_whitespace()
            .nth(11)
            .and_then(|ticks| ticks.parse().ok())
            .unwrap_or(0);
        ticks * 10_000_000
    }

    /// CPU time the process `pid` has used so far, summed over its threads, in nanoseconds.
    fn cpu_nanos(pid: u32) -> u64 {
        let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return 0;
        };
        threads
            .filter_map(|thread| {
                let stat = std::fs::read_to_string(thread.ok()?.path().join("schedstat")).ok()?;
                stat.split_whitespace().next()?.parse::<u64>().ok()
            })
            .sum()
    }

    pub(super) async fn run() {
        let streams = setting("LOADTEST_STREAMS", 1000);
        let events = setting("LOADTEST_STREAM_EVENTS", 200);
        let gap = Duration::from_millis(setting("LOADTEST_STREAM_GAP_MS", 10));
        let binary = std::env::current_exe().unwrap().with_file_name("gateway");
        if !binary.exists() {
            eprintln!(
                "{} not built; skipping the streaming part",
                binary.display()
            );
            return;
        }
        EPOCH.get_or_init(Instant::now);
        let provider = provider(gap).await;

        // The bare proxy: this binary again, as a process of its own like the gateway's.
        let proxy_address = super::free_address();
        let mut proxy = std::process::Command::new(std::env::current_exe().unwrap())
            .env(PROXY_UPSTREAM, &provider)
            .env(PROXY_LISTEN, &proxy_address)
            .spawn()
            .unwrap();

        // The gateway binary, on a SQLite file, streaming on, in front of the provider.
        let dir = tempfile::tempdir().unwrap();
        let catalogue = dir.path().join("models.toml");
        std::fs::write(
            &catalogue,
            format!(
                "streaming = true\n[[upstreams]]\nname = \"fake\"\nkind = \"openai\"\nbase_url = \"{provider}/v1\"\napi_key_env = \"FAKE_KEY\"\n\
                 [[models]]\nname = \"gpt-4o-mini\"\nprotocol = \"chat_completions\"\nprice = 1\nupstream = \"fake\"\n"
            ),
        )
        .unwrap();
        let listen = super::free_address();
        let url = format!(
            "sqlite://{}?mode=rwc",
            dir.path().join("streams.db").display()
        );
        let command = |args: &[&str]| {
            let mut command = std::process::Command::new(&binary);
            command
                .args(args)
                .env("DATABASE_URL", &url)
                .env("GATEWAY_LISTEN", &listen)
                .env("GATEWAY_MODELS", &catalogue)
                .env("FAKE_KEY", "sk-fake")
                .env("MOCK_UPSTREAM", "0")
                .env("RUST_LOG", "warn");
            command
        };
        let output = command(&["keys", "create", "--subscription", "100000000"])
            .output()
            .unwrap();
        let key = String::from_utf8(output.stdout)
            .unwrap()
            .lines()
            .last()
            .unwrap()
            .to_owned();
        let mut gateway = command(&["serve"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        super::listening(&listen).await;
        super::listening(&proxy_address).await;
        let pid = gateway.id();
        let idle = resident_kib(pid);

        println!("\nstreaming: {streams} concurrent streams of {events} events, one every {gap:?}");
        let mut direct = drive(
            &format!("{provider}/v1/chat/completions"),
            "none",
            streams,
            events,
        )
        .await;
        let (mut bare, bare_cpu, bare_user) =
            drive_through(&proxy_address, proxy.id(), "none", streams, events).await;
        // Sample the gateway's memory while its streams are open.
        let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let sampler = {
            let peak = peak.clone();
            tokio::spawn(async move {
                loop {
                    peak.fetch_max(resident_kib(pid), std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        };
        // The gateway's own work per event, which does not depend on what else shares the
        // machine's cores (its added latency does).
        let (mut through, gateway_cpu, gateway_user) =
            drive_through(&listen, pid, &key, streams, events).await;
        sampler.abort();

        // One stream at a time: the time to the first event with nothing else going on.
        let mut alone = Vec::new();
        for (base, key) in [
            (provider.clone(), "none"),
            (format!("http://{listen}"), key.as_str()),
        ] {
            let mut firsts = Vec::new();
            for _ in 0..FIRST_EVENT_ROUNDS {
                firsts.extend(
                    drive(&format!("{base}/v1/chat/completions"), key, 1, 1)
                        .await
                        .first_events,
                );
            }
            alone.push((percentile(&mut firsts, 0.5), percentile(&mut firsts, 0.99)));
        }
        println!(
            "one stream at a time ({FIRST_EVENT_ROUNDS} each), time to the first event: provider p50 {:.3} ms \
             p99 {:.3} ms; through the gateway p50 {:.3} ms p99 {:.3} ms; added p50 {:+.3} ms",
            alone[0].0 as f64 / 1000.0,
            alone[0].1 as f64 / 1000.0,
            alone[1].0 as f64 / 1000.0,
            alone[1].1 as f64 / 1000.0,
            (alone[1].0 as f64 - alone[0].0 as f64) / 1000.0,
        );

        println!(
            "{:<24} {:>12} {:>13} {:>13} {:>15} {:>15}",
            "target", "events/s", "event p50 ms", "event p99 ms", "first p50 ms", "first p99 ms"
        );
        let mut figures = Vec::new();
        for (name, run) in [
            ("provider alone", &mut direct),
            ("through a bare proxy", &mut bare),
            ("through the gateway", &mut through),
        ] {
            let rate = run.events as f64 / run.elapsed.as_secs_f64();
            let (p50, p99) = (
                percentile(&mut run.latencies, 0.5),
                percentile(&mut run.latencies, 0.99),
            );
            let (f50, f99) = (
                percentile(&mut run.first_events, 0.5),
                percentile(&mut run.first_events, 0.99),
            );
            println!(
                "{name:<24} {rate:>12.0} {:>13.3} {:>13.3} {:>15.3} {:>15.3}",
                p50 as f64 / 1000.0,
                p99 as f64 / 1000.0,
                f50 as f64 / 1000.0,
                f99 as f64 / 1000.0
            );
            figures.push((p50, p99, f50));
        }
        let added = |through: (u64, u64, u64)| {
            let direct = figures[0];
            format!(
                "p50 {:+.3} ms, p99 {:+.3} ms; to the first event (p50): {:+.3} ms",
                (through.0 as f64 - direct.0 as f64) / 1000.0,
                (through.1 as f64 - direct.1 as f64) / 1000.0,
                (through.2 as f64 - direct.2 as f64) / 1000.0,
            )
        };
        println!("the bare proxy adds per event: {}", added(figures[1]));
        println!("the gateway adds per event: {}", added(figures[2]));
        let per_event = |cpu: u64, events: u64| cpu as f64 / 1000.0 / events.max(1) as f64;
        println!(
            "CPU per event passed on: bare proxy {:.1} us ({:.1} us in user space), gateway {:.1} us \
             ({:.1} us in user space) ({} events, {:.2} s of CPU)",
            per_event(bare_cpu, bare.events),
            per_event(bare_user, bare.events),
            per_event(gateway_cpu, through.events),
            per_event(gateway_user, through.events),
            through.events,
            gateway_cpu as f64 / 1e9,
        );
        println!(
            "gateway resident memory: {:.1} MiB idle, {:.1} MiB at most with {streams} streams open",
            idle as f64 / 1024.0,
            peak.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1024.0
        );
        for child in [&mut gateway, &mut proxy] {
            child.kill().ok();
            child.wait().ok();
        }
        // Counted in the database: the call-log API pages at most 1000 entries at a time.
        let store = model_gateway::SeaOrmStore::connect(&url).await.unwrap();
        let ok = super::ok_entries(&store).await;
        let through_gateway = streams + FIRST_EVENT_ROUNDS;
        println!(
            "streams billed: {ok} ok of {through_gateway} through the gateway: {}",
            if ok == through_gateway {
                "match"
            } else {
                "MISMATCH"
            }
        );
        assert_eq!(ok, through_gateway);
    }
}
