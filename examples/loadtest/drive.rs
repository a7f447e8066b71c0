//! Driving a target with keep-alive connections, and printing what was measured.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use model_gateway::store::GroupCommitStats;

use crate::targets::{
    BODY, CLAUDE_CHAT_BODY, COSTED_BODY, MESSAGES_BODY, METERED_BODY, RESPONSES_BODY, Target,
};

#[derive(Clone, Copy)]
pub struct Figures {
    pub rps: f64,
    pub p50: Duration,
    pub p99: Duration,
    pub ok: u64,
    /// CPU time of the whole process (load generator included) per request, where the OS says.
    pub cpu_per_request: Option<Duration>,
}

/// CPU time this process has used so far (user + system), from `/proc/self/stat` on Linux.
pub fn process_cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // Linux reports these in USER_HZ, which is 100 on every architecture it supports.
    Some(Duration::from_millis(ticks * 10))
}

/// What a run sends.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Load {
    /// The same paid call each time, answered 200.
    Calls,
    /// The same paid call on `POST /v1/responses`, answered 200.
    Responses,
    /// The same paid call on `POST /v1/messages`, answered 200.
    Messages,
    /// The same paid chat call of a model served by an Anthropic provider, answered 200.
    ChatToMessages,
    /// The same paid call of a token-priced model ([`METERED_BODY`]), answered 200.
    Metered,
    /// The same paid call of a token-priced model with cost prices and tiers
    /// ([`COSTED_BODY`]), answered 200.
    Costed,
    /// Requests the gateway refuses, in turn: a wrong key (401), a body that is not JSON (400),
    /// an unknown model (404). Counted as answered when refused as expected.
    Refusals,
}

/// The `n`th refused request of a [`Load::Refusals`] run: its key, body and expected status.
fn refusal(n: u64, key: &str) -> (&str, &'static str, u16) {
    match n % 3 {
        0 => ("sk-mg-not-a-key", BODY, 401),
        1 => (key, "{\"model\": not json", 400),
        _ => (
            key,
            r#"{"model":"no-such-model","messages":[{"role":"user","content":"Hi"}]}"#,
            404,
        ),
    }
}

/// The load generator's HTTP client. reqwest, by default; `LOADTEST_CLIENT=hyper` sends with
/// hyper's own pooled client instead, which skips what reqwest adds to each request (the URL
/// parsed twice more, for its redirect policy and its proxy matcher: about 19k instructions a
/// request under callgrind, on the two cores the server shares). Ratios against the floor are
/// read with the same client on both sides; a leaner client leaves more of the machine to the
/// servers, so the floors rise more than the gateways do.
///
/// Each posts to one URL: reqwest parses its text on each request, as the load test always
/// sent it; hyper's client is given it parsed.
#[derive(Clone)]
enum Client {
    Reqwest(reqwest::Client, String),
    Hyper(
        Box<
            hyper_util::client::legacy::Client<
                hyper_util::client::legacy::connect::HttpConnector,
                http_body_util::Full<bytes::Bytes>,
            >,
        >,
        http::Uri,
    ),
}

impl Client {
    fn new(concurrency: usize, url: String) -> Client {
        if std::env::var("LOADTEST_CLIENT").as_deref() == Ok("hyper") {
            let client =
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .pool_max_idle_per_host(concurrency)
                    .build_http();
            return Client::Hyper(Box::new(client), url.parse().unwrap());
        }
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(concurrency)
            .build()
            .unwrap();
        Client::Reqwest(client, url)
    }

    /// Posts `body` (with `key` as a bearer token unless empty, and an idempotency
    /// key if given), reads the answer to the end, and returns its status.
    async fn post(&self, key: &str, body: &'static str, keyed: Option<String>) -> u16 {
        match self {
            Client::Reqwest(client, url) => {
                let mut request = client
                    .post(url)
                    .header("content-type", "application/json")
                    .body(body);
                if !key.is_empty() {
                    request = request.bearer_auth(key);
                }
                if let Some(keyed) = keyed {
                    request = request.header("idempotency-key", keyed);
                }
                let response = request.send().await.unwrap();
                let status = response.status().as_u16();
                response.bytes().await.unwrap();
                status
            }
            Client::Hyper(client, url) => {
                use http_body_util::BodyExt;
                let mut request = http::Request::post(url.clone())
                    .header(http::header::CONTENT_TYPE, "application/json");
                if !key.is_empty() {
                    request = request.header(http::header::AUTHORIZATION, format!("Bearer {key}"));
                }
                if let Some(keyed) = keyed {
                    request = request.header("idempotency-key", keyed);
                }
                let body = http_body_util::Full::new(bytes::Bytes::from_static(body.as_bytes()));
                let response = client.request(request.body(body).unwrap()).await.unwrap();
                let status = response.status().as_u16();
                response.into_body().collect().await.unwrap();
                status
            }
        }
    }
}

/// `requests` calls over `concurrency` keep-alive connections.
pub async fn drive(target: &Target, concurrency: usize, requests: u64) -> Figures {
    drive_load(target, concurrency, requests, Load::Calls).await
}

/// `requests` of `load` over `concurrency` keep-alive connections; `ok` counts the answers
/// that were what the load expects.
pub async fn drive_load(target: &Target, concurrency: usize, requests: u64, load: Load) -> Figures {
    let (path, body) = match load {
        Load::Responses => ("/v1/responses", RESPONSES_BODY),
        Load::Messages => ("/v1/messages", MESSAGES_BODY),
        Load::ChatToMessages => ("/v1/chat/completions", CLAUDE_CHAT_BODY),
        Load::Metered => ("/v1/chat/completions", METERED_BODY),
        Load::Costed => ("/v1/chat/completions", COSTED_BODY),
        Load::Calls | Load::Refusals => ("/v1/chat/completions", BODY),
    };
    let client = Client::new(concurrency, format!("{}{path}", target.base));
    let keyed = std::env::var("LOADTEST_IDEMPOTENCY_KEYS").as_deref() == Ok("1");
    let run = fastrand::u64(..);
    let issued = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let cpu_before = process_cpu_time();
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (client, key) = (client.clone(), target.key.clone());
            let (issued, ok) = (issued.clone(), ok.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                loop {
                    let n = issued.fetch_add(1, Ordering::Relaxed);
                    if n >= requests {
                        break;
                    }
                    let (key, body, expected) = match (load, key.as_deref()) {
                        (Load::Refusals, Some(key)) => refusal(n, key),
                        (_, key) => (key.unwrap_or_default(), body, 200),
                    };
                    let keyed = keyed.then(|| format!("lt-{run}-{n}"));
                    let sent = Instant::now();
                    let status = client.post(key, body, keyed).await;
                    latencies.push(sent.elapsed());
                    if status == expected {
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

pub fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

pub fn print_figures(target: &Target, concurrency: usize, figures: &Figures, floor: &Figures) {
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
pub fn print_ledger(before: GroupCommitStats, after: GroupCommitStats) {
    let writes = after.writes - before.writes;
    let per = |count: u64| writes as f64 / count.max(1) as f64;
    println!(
        "{:<27} ledger: {writes} writes, {:.1} per transaction, {:.1} per flush",
        "",
        per(after.transactions - before.transactions),
        per(after.flushes - before.flushes),
    );
}

/// Runs each of `loads` against `target`, alternated, `rounds` times (after a warm-up each
/// time), and prints one row per load with its label: the medians of req/s, p50, p99 and the
/// process's CPU per call.
pub async fn compare_loads(
    target: &Target,
    concurrency: usize,
    requests: u64,
    rounds: usize,
    loads: &[(Load, &str)],
) {
    let mut runs: Vec<Vec<Figures>> = vec![Vec::new(); loads.len()];
    for round in 0..rounds {
        // The order turns round each round (ABBA), so that a machine that slows down or
        // speeds up during a run weighs on every load alike.
        let mut order: Vec<usize> = (0..loads.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for index in order {
            let load = loads[index].0;
            drive_load(target, concurrency, 300, load).await; // warm-up
            let measured = drive_load(target, concurrency, requests, load).await;
            assert_eq!(measured.ok, requests, "not every call answered 200");
            runs[index].push(measured);
        }
    }
    for ((_, label), figures) in loads.iter().zip(&runs) {
        let median = |pick: fn(&Figures) -> f64| median(figures, pick);
        println!(
            "{:<11} {:<10} {:>4} {:>10.0} {:>9.3} {:>9.3} {:>12.1}",
            target.name,
            label,
            concurrency,
            median(|f| f.rps),
            median(|f| ms(f.p50)),
            median(|f| ms(f.p99)),
            // The whole process's (load generator, gateway and provider), per call.
            median(|f| f
                .cpu_per_request
                .map_or(f64::NAN, |cpu| cpu.as_secs_f64() * 1e6)),
        );
    }
    // Each load against the first, round by round: on a machine whose speed drifts, the
    // ratio of two runs side by side is steadier than the ratio of two medians. The process's
    // CPU time a call too, where it is known: on a noisy machine it tells a few per cent of
    // extra work better than requests a second do.
    let (first, first_label) = (&runs[0], loads[0].1);
    let cpu = |figures: &Figures| figures.cpu_per_request.map(|cpu| cpu.as_secs_f64());
    for ((_, label), figures) in loads.iter().zip(&runs).skip(1) {
        let rps: Vec<f64> = figures
            .iter()
            .zip(first)
            .map(|(run, beside)| run.rps / beside.rps)
            .collect();
        let cpu: Option<Vec<f64>> = figures
            .iter()
            .zip(first)
            .map(|(run, beside)| Some(cpu(run)? / cpu(beside)?))
            .collect();
        for (what, ratios) in [("req/s", Some(rps)), ("cpu/call", cpu)] {
            let Some(ratios) = ratios else { continue };
            let (low, high) = ratios
                .iter()
                .fold((f64::INFINITY, 0f64), |(low, high), &r| {
                    (low.min(r), high.max(r))
                });
            let each: Vec<String> = ratios.iter().map(|r| format!("{r:.3}")).collect();
            println!(
                "{:<11} {:<10} {:>4} {what} {:.3}x {first_label}'s, round by round (median; {low:.3} to {high:.3}: {})",
                target.name,
                label,
                concurrency,
                median(&ratios, |r| *r),
                each.join(" "),
            );
        }
    }
}

/// The median of `pick` over `runs` (the mean of the middle two of an even count: taking the
/// upper one read every ratio of six rounds high, chat against itself included).
pub fn median<T>(runs: &[T], pick: impl Fn(&T) -> f64) -> f64 {
    let mut values: Vec<f64> = runs.iter().map(pick).collect();
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    match values.len() % 2 {
        1 => values[middle],
        _ => (values[middle - 1] + values[middle]) / 2.0,
    }
}
