//! A token-priced model beside a per-call one (`LOADTEST_ONLY=tokens`): the same question to
//! `gpt-4o-mini` (2 credits a call) and to `gpt-4o-mini-metered` (credits per million tokens:
//! its reservation is a ceiling, its settle charges the mock's usage and returns the rest), on
//! the in-memory gateway and on an owned `SQLite` file, alternated, `LOADTEST_ROUNDS` times, at
//! concurrency 16 and 64; medians printed.

use crate::drive::{Load, compare_loads};
use crate::targets::{METERED_MODEL, gateway_with, memory_gateway_with, owned_store};
use model_gateway::{Catalogue, catalogue::DEMO_CATALOGUE};

pub async fn run(requests: u64, rounds: usize) {
    let catalogue = || Catalogue::from_toml(&format!("{DEMO_CATALOGUE}\n{METERED_MODEL}")).unwrap();
    let memory = memory_gateway_with("in-memory", catalogue()).await;
    let dir = tempfile::tempdir().unwrap();
    let owned = gateway_with("owned file", owned_store(dir.path()).await, catalogue()).await;
    println!("{requests} requests per run, {rounds} rounds, alternated");
    println!(
        "{:<11} {:<10} {:>4} {:>10} {:>9} {:>9} {:>12}",
        "gateway", "priced", "c", "req/s", "p50 ms", "p99 ms", "cpu us/call"
    );
    for concurrency in [16, 64] {
        for target in [&memory, &owned] {
            let loads = [(Load::Calls, "per call"), (Load::Metered, "by tokens")];
            compare_loads(target, concurrency, requests, rounds, &loads).await;
        }
    }
}
