//! End-to-end load test, in one run, on this machine:
//!
//! 1. the floor: an axum server that parses the body and returns the same mock reply, with
//!    none of our layers;
//! 2. the skeleton: the floor on the gateway's own server (`model_gateway::server`), plus the
//!    least any gateway must do per call: the key's SHA-256 looked up, the balance taken from
//!    atomically, a call-log entry pushed, a request id on the answer. No layers, none of the
//!    gateway's other rules: what a gateway with no cost beyond that work could reach here;
//! 3. the full example gateway (all four layers, behind `model_gateway::server` as the example
//!    serves them) in mock mode on the in-memory store: what HTTP and the layers cost without a
//!    database;
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
//! `LOADTEST_ONLY=responses` runs instead `POST /v1/responses` beside chat completions through
//! the in-memory gateway, in mock mode, through a translating upstream and through a native one
//! (see `responses.rs`).
//!
//! `LOADTEST_ONLY=tokens` runs instead a token-priced model beside a per-call one, on the
//! in-memory gateway and an owned `SQLite` file (see `tokens.rs`).
//!
//! `LOADTEST_ONLY=economics` runs instead a token-priced model with cost prices and tiers beside
//! one without, through a provider in this process (see `economics.rs`).
//!
//! `LOADTEST_ONLY=rate` runs instead an open-loop load at fixed rates (2,000 and 5,000
//! requests a second, `LOADTEST_RATES`, for `LOADTEST_SECONDS` each) against the floor and an
//! owned `SQLite` file, and prints latency from when each request was due (see `rate.rs`).
//!
//! `LOADTEST_ONLY=logged` runs instead the release gateway binary as an operator runs it (mock
//! mode, an owned `SQLite` file, logging at `info` to a file): paid calls, then a flood of
//! requests it refuses (a wrong key, a body that is not JSON, an unknown model), at concurrency
//! 16 and 64; `LOADTEST_GATEWAY_BIN` runs another build of the binary, to compare two.
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
//! `LOADTEST_CLIENT=hyper` sends with hyper's pooled client instead of reqwest, whose own work
//! per request (the URL parsed three times) takes a share of the two cores the servers run on.

// The load test unwraps (a panic is how it fails).
#![allow(clippy::unwrap_used, unreachable_pub)]

// The tests' helpers: a free port, waiting for a listener, the test PostgreSQL's URL.
#[allow(unused_imports)]
#[path = "../../tests/common/mod.rs"]
mod common;
mod drive;
mod economics;
mod journal;
mod logged;
mod memory;
mod rate;
mod responses;
mod streaming;
mod targets;
mod tokens;

use drive::{Figures, drive, ms, print_figures, print_ledger};
use model_gateway::SeaOrmStore;
use sea_orm::ConnectionTrait;
use targets::{floor, gateway, memory_gateway, ok_entries, owned_store, skeleton};

const CONCURRENCY: [usize; 3] = [1, 16, 64];

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
    if std::env::var("LOADTEST_ONLY").as_deref() == Ok("rate") {
        rate::run().await;
        return;
    }
    let requests: u64 = std::env::var("LOADTEST_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let rounds: usize = std::env::var("LOADTEST_ROUNDS")
        .map(|rounds| rounds.parse().expect("LOADTEST_ROUNDS is a number"))
        .unwrap_or(1);
    if std::env::var("LOADTEST_ONLY").as_deref() == Ok("logged") {
        logged::run(requests, rounds).await;
        return;
    }
    if std::env::var("LOADTEST_ONLY").as_deref() == Ok("responses") {
        responses::run(requests, rounds).await;
        return;
    }
    if std::env::var("LOADTEST_ONLY").as_deref() == Ok("economics") {
        economics::run(requests, rounds).await;
        return;
    }
    if std::env::var("LOADTEST_ONLY").as_deref() == Ok("tokens") {
        tokens::run(requests, rounds).await;
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sqlite_url = format!("sqlite://{}?mode=rwc", dir.path().join("load.db").display());
    let mut targets = vec![
        floor(None).await,
        skeleton().await,
        memory_gateway().await,
        gateway(
            "gateway, SQLite",
            SeaOrmStore::connect(&sqlite_url).await.unwrap(),
        )
        .await,
        // The same, with the file owned: reservations held in memory, one write per call.
        gateway("gateway, SQLite owned", owned_store(dir.path()).await).await,
    ];
    let postgres = common::postgres_url();
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
                let median = |pick: fn(&(f64, f64)) -> f64| drive::median(rounds, pick);
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
    if let Some((idle, loaded)) = memory::resident_memory_with_1000_connections().await {
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
