//! The streaming part of the load test (see the crate docs).

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use axum::body::Bytes;

use crate::common::resident_kib;

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
    let router = axum::Router::new().route("/v1/chat/completions", axum::routing::post(handler));
    crate::targets::serve(router).await
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
    let router = axum::Router::new().route("/v1/chat/completions", axum::routing::post(handler));
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
                            let stamp: u64 = stamp.1.trim_end_matches(['}', '\n']).parse().unwrap();
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
    let proxy_address = crate::common::free_address();
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
    let listen = crate::common::free_address();
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
    let key =
        crate::targets::created_key(command(&["keys", "create", "--subscription", "100000000"]));
    let mut gateway = command(&["serve"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    crate::common::listening(&listen).await;
    crate::common::listening(&proxy_address).await;
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
    let ok = crate::targets::ok_entries(&store).await;
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
