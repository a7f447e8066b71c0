//! A token-priced model beside a per-call one (`LOADTEST_ONLY=tokens`): the same question to
//! `gpt-4o-mini` (2 credits a call) and to `gpt-4o-mini-metered` (credits per million tokens:
//! its reservation is a ceiling, its settle charges the mock's usage and returns the rest), on
//! the in-memory gateway and on an owned `SQLite` file, alternated, `LOADTEST_ROUNDS` times, at
//! concurrency 16 and 64; medians printed.

use crate::drive::{Figures, Load, drive_load, ms};
use crate::targets::{METERED_MODEL, Target, gateway_with, memory_gateway_with};
use model_gateway::{Catalogue, SeaOrmStore, catalogue::DEMO_CATALOGUE};

pub async fn run(requests: u64, rounds: usize) {
    let catalogue = || Catalogue::from_toml(&format!("{DEMO_CATALOGUE}\n{METERED_MODEL}")).unwrap();
    let memory = memory_gateway_with("in-memory", catalogue()).await;
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("owned.db").display()
    );
    let owned = SeaOrmStore::connect(&url)
        .await
        .unwrap()
        .own_file()
        .unwrap();
    let owned = gateway_with("owned file", owned, catalogue()).await;
    println!("{requests} requests per run, {rounds} rounds, alternated");
    println!(
        "{:<11} {:<9} {:>4} {:>10} {:>9} {:>9} {:>12}",
        "gateway", "priced", "c", "req/s", "p50 ms", "p99 ms", "cpu us/call"
    );
    for concurrency in [16, 64] {
        for target in [&memory, &owned] {
            compare(target, concurrency, requests, rounds).await;
        }
    }
}

async fn compare(target: &Target, concurrency: usize, requests: u64, rounds: usize) {
    let mut runs: Vec<(Load, Vec<Figures>)> =
        vec![(Load::Calls, Vec::new()), (Load::Metered, Vec::new())];
    for _ in 0..rounds {
        for (load, figures) in &mut runs {
            drive_load(target, concurrency, 300, *load).await; // warm-up
            let measured = drive_load(target, concurrency, requests, *load).await;
            assert_eq!(measured.ok, requests, "not every call answered 200");
            figures.push(measured);
        }
    }
    for (load, figures) in &runs {
        let median = |pick: fn(&Figures) -> f64| {
            let mut values: Vec<f64> = figures.iter().map(pick).collect();
            values.sort_by(f64::total_cmp);
            values[values.len() / 2]
        };
        let priced = match load {
            Load::Metered => "by tokens",
            _ => "per call",
        };
        println!(
            "{:<11} {:<9} {:>4} {:>10.0} {:>9.3} {:>9.3} {:>12.1}",
            target.name,
            priced,
            concurrency,
            median(|f| f.rps),
            median(|f| ms(f.p50)),
            median(|f| ms(f.p99)),
            median(|f| f
                .cpu_per_request
                .map_or(f64::NAN, |cpu| cpu.as_secs_f64() * 1e6)),
        );
    }
}
