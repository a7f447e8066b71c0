//! `LOADTEST_ONLY=rate`: latency at a fixed rate, as `TensorZero` and others publish it. An
//! open-loop generator sends the same paid call at 2,000 and 5,000 requests a second
//! (`LOADTEST_RATES` to change them) for `LOADTEST_SECONDS` (default 5) to the floor (no layers),
//! the durable floor (each reply waits for a group-committed, `fdatasync`ed record), the four
//! layers on the in-memory store, and the gateway on its embedded default, an owned `SQLite`
//! file, in one run. "p99 added" is a row's p99 less the floor's.
//!
//! Open loop: request `i` is due at `start + i / rate`, whatever happened to the ones before
//! it, and its latency counts from when it was due, not from when it was sent, so a generator
//! or server that falls behind shows it (no coordinated omission). A thread of its own keeps
//! the schedule (a `std` sleep wakes within tens of microseconds; a Tokio timer only every
//! millisecond) and hands each request to the runtime when it is due; each request takes an
//! idle keep-alive connection from the client's pool, or opens one.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::journal::Journal;
use crate::targets::{BODY, Target, floor, gateway, memory_gateway, owned_store};

/// What one target did at one rate.
struct AtRate {
    sent: u64,
    ok: u64,
    /// Latencies from when each request was due, sorted.
    latencies: Vec<Duration>,
    /// How late, at worst, the generator handed a request over.
    worst_lag: Duration,
}

impl AtRate {
    fn quantile(&self, q: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let at = ((self.latencies.len() - 1) as f64 * q).round() as usize;
        self.latencies[at]
    }
}

async fn at_rate(target: &Target, rate: u64, seconds: u64) -> AtRate {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()
        .unwrap();
    let url = format!("{}/v1/chat/completions", target.base);
    // Warm the pool and the gateway up.
    for _ in 0..200 {
        send(&client, &url, target.key.as_deref()).await;
    }
    let total = rate * seconds;
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(total as usize)));
    let ok = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let runtime = tokio::runtime::Handle::current();
    let (done, finished) = tokio::sync::oneshot::channel();
    let schedule = {
        let (latencies, ok) = (latencies.clone(), ok.clone());
        let key = target.key.clone();
        std::thread::spawn(move || {
            let start = Instant::now() + Duration::from_millis(20);
            let mut worst_lag = Duration::ZERO;
            let mut tasks = Vec::with_capacity(total as usize);
            for i in 0..total {
                let due = start + Duration::from_nanos(i * 1_000_000_000 / rate);
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                worst_lag = worst_lag.max(Instant::now().saturating_duration_since(due));
                let (client, url, key) = (client.clone(), url.clone(), key.clone());
                let (latencies, ok) = (latencies.clone(), ok.clone());
                tasks.push(runtime.spawn(async move {
                    if send(&client, &url, key.as_deref()).await {
                        ok.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    latencies.lock().unwrap().push(due.elapsed());
                }));
            }
            let _ = done.send((tasks, worst_lag));
        })
    };
    let (tasks, worst_lag) = finished.await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }
    schedule.join().unwrap();
    let mut latencies = std::mem::take(&mut *latencies.lock().unwrap());
    latencies.sort();
    AtRate {
        sent: total,
        ok: ok.load(std::sync::atomic::Ordering::Relaxed),
        latencies,
        worst_lag,
    }
}

async fn send(client: &reqwest::Client, url: &str, key: Option<&str>) -> bool {
    let mut request = client
        .post(url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(BODY);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    match request.send().await {
        Ok(answer) => answer.status() == 200 && answer.bytes().await.is_ok(),
        Err(_) => false,
    }
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

pub async fn run() {
    let seconds: u64 = std::env::var("LOADTEST_SECONDS")
        .ok()
        .and_then(|seconds| seconds.parse().ok())
        .unwrap_or(5);
    let rates: Vec<u64> = std::env::var("LOADTEST_RATES")
        .unwrap_or_else(|_| "2000,5000".into())
        .split(',')
        .map(|rate| rate.trim().parse().expect("LOADTEST_RATES: numbers"))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let targets = [
        floor(None).await,
        floor(Some(Journal::create(&dir.path().join("floor.journal")))).await,
        memory_gateway().await,
        gateway("gateway, SQLite owned", owned_store(dir.path()).await).await,
    ];
    println!(
        "machine: {} cores; open loop, {seconds} s per rate; latency from when each request was due",
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    println!(
        "{:<24} {:>6} {:>8} {:>8} {:>8} {:>9} {:>9} {:>12} {:>12}",
        "target", "rate", "ok", "p50 ms", "p99 ms", "p99.9 ms", "max ms", "p99 added", "worst lag"
    );
    for rate in rates {
        let mut floor_p99 = None;
        for target in &targets {
            let measured = at_rate(target, rate, seconds).await;
            let p99 = measured.quantile(0.99);
            let added = floor_p99.map_or(0.0, |floor: Duration| ms(p99) - ms(floor));
            floor_p99.get_or_insert(p99);
            println!(
                "{:<24} {:>6} {:>8} {:>8.3} {:>8.3} {:>9.3} {:>9.3} {:>+12.3} {:>9.3} ms",
                target.name,
                rate,
                format!("{}/{}", measured.ok, measured.sent),
                ms(measured.quantile(0.5)),
                ms(p99),
                ms(measured.quantile(0.999)),
                ms(measured.latencies.last().copied().unwrap_or_default()),
                added,
                ms(measured.worst_lag),
            );
        }
    }
}
