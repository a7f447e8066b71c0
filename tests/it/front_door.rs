//! The front door holds: slow and greedy clients cannot take the gateway down. The example
//! gateway's router behind `model_gateway::server`, in this process with short limits, and the
//! gateway binary itself where a file limit or resident memory is what is tested.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use model_gateway::server::{self, ServerLimits};
use model_gateway::{Catalogue, Upstream, router::BodyLimits, upstream::MockUpstream};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Short limits, so each test sees its rule act within a second or two.
fn short_limits() -> ServerLimits {
    let mut limits = ServerLimits::default();
    limits.header_timeout = Duration::from_secs(1);
    limits.idle_timeout = Duration::from_secs(2);
    limits.max_connections = 64;
    limits
}

fn short_body_limits() -> BodyLimits {
    BodyLimits::new(4 * 1024 * 1024)
        .idle_timeout(Duration::from_secs(1))
        .deadline(Duration::from_secs(3))
}

/// The example gateway's router (mock mode) served by `model_gateway::server`; its address.
async fn serve(db: &TestDb, limits: ServerLimits, body: BodyLimits) -> String {
    let router = model_gateway::Gateway::new(
        db.store.clone(),
        Arc::new(Catalogue::demo()),
        Upstream::Mock(MockUpstream::new()),
    )
    .body_limits(body)
    .router();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    tokio::spawn(server::serve(
        listener,
        router,
        limits,
        std::future::pending(),
    ));
    address
}

/// Reads until the server closes the connection or `within` passes; what arrived, and whether
/// the connection was closed.
async fn read_until_closed(stream: &mut TcpStream, within: Duration) -> (String, bool) {
    let mut received = Vec::new();
    let mut buffer = [0u8; 8192];
    let closed = tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(read) => received.extend_from_slice(&buffer[..read]),
            }
        }
    })
    .await
    .is_ok();
    (String::from_utf8_lossy(&received).into_owned(), closed)
}

/// The status and `detail` of an HTTP/1.1 response as received.
fn status_and_detail(response: &str) -> (u16, String) {
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|status| status.parse().ok())
        .unwrap_or(0);
    let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
    let detail = serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|body| body["detail"].as_str().map(str::to_owned))
        .unwrap_or_default();
    (status, detail)
}

fn head(key: &str, length_header: &str) -> String {
    format!(
        "POST {CHAT} HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\n{length_header}\r\n"
    )
}

#[tokio::test]
async fn headers_that_never_finish_are_cut_at_the_header_time_out() {
    let db = local_db().await;
    let address = serve(&db, short_limits(), short_body_limits()).await;
    let mut stream = TcpStream::connect(&address).await.unwrap();
    stream
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let (_, closed) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    assert!(
        closed,
        "a client that stops mid-headers kept its connection"
    );
    assert!(started.elapsed() >= Duration::from_millis(900));
}

/// A body that stops arriving is answered 408 with a detail, and nothing is charged.
async fn assert_unfinished_body_gets_408(length_header: &str, partial: &str) {
    let db = local_db().await;
    let address = serve(&db, short_limits(), short_body_limits()).await;
    let key = db.funded_key(10, 0).await;
    let mut stream = TcpStream::connect(&address).await.unwrap();
    let request = head(&key, length_header) + partial;
    stream.write_all(request.as_bytes()).await.unwrap();
    let (response, _) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    let (status, detail) = status_and_detail(&response);
    assert_eq!(status, 408, "{response}");
    assert!(detail.contains("请求超时"), "{response}");
    assert!(db.calls(&key).await.is_empty());
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

#[tokio::test]
async fn a_body_shorter_than_its_declared_length_gets_408() {
    assert_unfinished_body_gets_408("content-length: 1000\r\n", r#"{"model":"gpt-4o-mini","#).await;
}

#[tokio::test]
async fn a_chunked_body_without_its_end_gets_408() {
    assert_unfinished_body_gets_408("transfer-encoding: chunked\r\n", "5\r\n{\"mod\r\n").await;
}

#[tokio::test]
async fn a_body_that_trickles_past_its_deadline_gets_408() {
    let db = local_db().await;
    let address = serve(&db, short_limits(), short_body_limits()).await;
    let key = db.funded_key(10, 0).await;
    let mut stream = TcpStream::connect(&address).await.unwrap();
    stream
        .write_all(head(&key, "content-length: 100\r\n").as_bytes())
        .await
        .unwrap();
    // A byte every 300 ms: never idle for the 1 s time-out, but past the 3 s deadline. The
    // answer is read while the client still sends (a reset would discard it otherwise).
    let started = Instant::now();
    let (mut reading, mut writing) = stream.into_split();
    let trickle = tokio::spawn(async move {
        for _ in 0..20 {
            if writing.write_all(b" ").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
    let mut response = Vec::new();
    let mut buffer = [0u8; 4096];
    while !response.ends_with(b"}") {
        match tokio::time::timeout(Duration::from_secs(6), reading.read(&mut buffer)).await {
            Ok(Ok(read)) if read > 0 => response.extend_from_slice(&buffer[..read]),
            _ => break,
        }
    }
    trickle.abort();
    let response = String::from_utf8_lossy(&response).into_owned();
    assert_eq!(status_and_detail(&response).0, 408, "{response}");
    assert!(started.elapsed() >= Duration::from_secs(3));
    assert!(db.calls(&key).await.is_empty());
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_after_the_idle_time_out() {
    let db = local_db().await;
    let address = serve(&db, short_limits(), short_body_limits()).await;
    let key = db.funded_key(10, 0).await;
    let mut stream = TcpStream::connect(&address).await.unwrap();
    let body = chat_body(CHAT_MODEL);
    let request = head(&key, &format!("content-length: {}\r\n", body.len())) + &body;
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut buffer = [0u8; 4096];
    let read = stream.read(&mut buffer).await.unwrap();
    assert!(buffer[..read].starts_with(b"HTTP/1.1 200"));
    // Kept alive after the answer, then closed once idle for the 2 s time-out.
    let started = Instant::now();
    let (_, closed) = read_until_closed(&mut stream, Duration::from_secs(6)).await;
    assert!(closed, "an idle keep-alive connection stayed open");
    assert!(started.elapsed() >= Duration::from_secs(1));
}

#[tokio::test]
async fn a_large_body_from_a_key_that_cannot_pay_is_refused_early_and_a_funded_one_is_served() {
    let db = local_db().await;
    let address = serve(&db, short_limits(), short_body_limits()).await;
    let client = reqwest::Client::new();
    // A 2 MiB request: a valid call with a long message.
    let long = "x".repeat(2 * 1024 * 1024);
    let body = serde_json::json!({
        "model": CHAT_MODEL, "messages": [{ "role": "user", "content": long }]
    })
    .to_string();
    let call = |key: String| {
        client
            .post(format!("http://{address}{CHAT}"))
            .bearer_auth(key)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
    };
    let poor = db.funded_key(0, 0).await; // the cheapest demo model costs 1
    let refused = call(poor.clone()).await.unwrap();
    assert_eq!(refused.status(), 413);
    let detail: Value = refused.json().await.unwrap();
    assert_eq!(detail["detail"], "请求体过大");
    assert!(db.calls(&poor).await.is_empty());

    let funded = db.funded_key(10, 0).await;
    assert_eq!(call(funded.clone()).await.unwrap().status(), 200);
    assert_eq!(db.balance(&funded).await, balance(10 - CHAT_PRICE, 0));

    // Below the unfunded cap the contract's order holds: 402 for the key without credits.
    let small = client
        .post(format!("http://{address}{CHAT}"))
        .bearer_auth(&poor)
        .body(chat_body(CHAT_MODEL))
        .send()
        .await
        .unwrap();
    assert_eq!(small.status(), 402);
}

#[tokio::test]
async fn a_header_block_over_the_limit_is_answered_431_with_a_detail() {
    let db = local_db().await;
    let address = serve(&db, short_limits(), short_body_limits()).await;
    let key = db.funded_key(10, 0).await;
    let response = reqwest::Client::new()
        .post(format!("http://{address}{CHAT}"))
        .bearer_auth(&key)
        .header("x-padding", "p".repeat(100 * 1024))
        .body(chat_body(CHAT_MODEL))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 431);
    let detail: Value = response.json().await.unwrap();
    assert_eq!(detail["detail"], "请求头过大");
    assert!(db.calls(&key).await.is_empty());
}

/// Over HTTP/2 (prior knowledge), a request refused before its body was read reaches the
/// client whole, with its detail, however large the body it was sending. curl is the client
/// that showed the failure (a stream reset made it drop the answer); reqwest is checked too.
#[tokio::test]
async fn http2_refusals_before_the_body_is_read_reach_the_client_intact() {
    let db = local_db().await;
    let address = serve(&db, short_limits(), short_body_limits()).await;
    let key = db.funded_key(10, 0).await;
    let dir = tempfile::tempdir().unwrap();
    let body_of = |name: &str, size: usize| {
        let path = dir.path().join(name);
        std::fs::write(&path, "x".repeat(size)).unwrap();
        path
    };
    let two_mib = body_of("two", 2 * 1024 * 1024);
    let five_mib = body_of("five", 5 * 1024 * 1024); // over the 4 MiB limit
    let cases = [
        (CHAT, None, &two_mib, 401, "无效的 API Key"),
        (
            "/v1/nowhere",
            Some(key.as_str()),
            &two_mib,
            404,
            "接口不存在",
        ),
        (CHAT, Some(key.as_str()), &five_mib, 413, "请求体过大"),
    ];
    for round in 0..10 {
        for (path, key, body, status, detail) in cases {
            let mut curl = std::process::Command::new("curl");
            curl.args([
                "-s",
                "--http2-prior-knowledge",
                "-X",
                "POST",
                "-w",
                "\n%{http_code} %{http_version}",
            ])
            .arg("--data-binary")
            .arg(format!("@{}", body.display()))
            .arg(format!("http://{address}{path}"));
            if let Some(key) = key {
                curl.args(["-H", &format!("authorization: Bearer {key}")]);
            }
            let output = tokio::task::spawn_blocking(move || curl.output())
                .await
                .unwrap()
                .expect("curl runs (.ci/run installs it)");
            let text = String::from_utf8_lossy(&output.stdout).into_owned();
            assert!(
                output.status.success(),
                "round {round}, {path}: curl {:?}: {text}",
                output.status
            );
            let (json, last) = text.rsplit_once('\n').unwrap();
            assert_eq!(last, format!("{status} 2"), "round {round}, {path}: {text}");
            let json: Value = serde_json::from_str(json).unwrap();
            assert_eq!(json["detail"], detail);

            let client = reqwest::Client::builder()
                .http2_prior_knowledge()
                .build()
                .unwrap();
            let mut request = client
                .post(format!("http://{address}{path}"))
                .body(std::fs::read(body).unwrap());
            if let Some(key) = key {
                request = request.bearer_auth(key);
            }
            let response = request.send().await.unwrap();
            assert_eq!(response.version(), reqwest::Version::HTTP_2);
            assert_eq!(response.status(), status);
            let json: Value = response.json().await.unwrap();
            assert_eq!(json["detail"], detail);
        }
    }
    assert!(db.calls(&key).await.is_empty());
}

/// The gateway binary in mock mode on a `SQLite` file of its own, with extra variables, run
/// under `prlimit` when `files` is given; its process, address and a funded key.
struct GatewayProcess {
    child: std::process::Child,
    address: String,
    key: String,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl GatewayProcess {
    async fn start(files: Option<u64>, vars: &[(&str, &str)]) -> GatewayProcess {
        let dir = tempfile::tempdir().unwrap();
        let address = free_address();
        let url = format!(
            "sqlite://{}?mode=rwc",
            dir.path().join("gateway.db").display()
        );
        let log = dir.path().join("gateway.log");
        let command = |program: &str| {
            let mut command = std::process::Command::new(program);
            command
                .env("DATABASE_URL", &url)
                .env("GATEWAY_LISTEN", &address)
                .env("MOCK_UPSTREAM", "1")
                .env("RUST_LOG", "warn")
                .envs(vars.iter().copied());
            command
        };
        let created = command(gateway_binary().to_str().unwrap())
            .args(["keys", "create", "--subscription", "1000000"])
            .output()
            .unwrap();
        let key = String::from_utf8(created.stdout)
            .unwrap()
            .lines()
            .last()
            .unwrap()
            .to_owned();
        let mut serve = match files {
            Some(files) => {
                let mut serve = command("prlimit");
                serve
                    .arg(format!("--nofile={files}:{files}"))
                    .arg(gateway_binary())
                    .arg("serve");
                serve
            }
            None => {
                let mut serve = command(gateway_binary().to_str().unwrap());
                serve.arg("serve");
                serve
            }
        };
        let child = serve
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("prlimit runs (util-linux)");
        let started = Instant::now();
        while TcpStream::connect(&address).await.is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the gateway did not start"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        GatewayProcess {
            child,
            address,
            key,
            log,
            _dir: dir,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// One chat call on a new connection: its status, and how long it took.
    async fn call(&self) -> (u16, Duration) {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let started = Instant::now();
        let status = client
            .post(format!("http://{}{CHAT}", self.address))
            .bearer_auth(&self.key)
            .body(chat_body(CHAT_MODEL))
            .send()
            .await
            .map_or(0, |response| response.status().as_u16());
        (status, started.elapsed())
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The length of the kernel's queue of connections not yet accepted on the socket listening at
/// `address`, as `ss` reports it (a listening socket's `Send-Q`).
fn listen_backlog(address: &str) -> u32 {
    let port = address.rsplit_once(':').unwrap().1;
    let output = std::process::Command::new("ss")
        .args(["-H", "-l", "-t", "-n", &format!("sport = :{port}")])
        .output()
        .unwrap();
    let listing = String::from_utf8(output.stdout).unwrap();
    let fields: Vec<&str> = listing.split_whitespace().collect();
    assert_eq!(fields.first(), Some(&"LISTEN"), "{listing}");
    fields[2].parse().unwrap()
}

/// A burst of clients connecting at once finds room in the queue the listener asked for, not
/// only in tokio's 128: `server::bind` with its backlog, and the example gateway with
/// `GATEWAY_LISTEN_BACKLOG` (and 4096 by default, capped by the OS).
#[tokio::test]
async fn listeners_queue_the_connections_asked_for() {
    let listener = server::bind("127.0.0.1:0", 37).await.unwrap();
    assert_eq!(
        listen_backlog(&listener.local_addr().unwrap().to_string()),
        37
    );
    let gateway = GatewayProcess::start(None, &[("GATEWAY_LISTEN_BACKLOG", "2000")]).await;
    assert_eq!(listen_backlog(&gateway.address), 2000);
    let gateway = GatewayProcess::start(None, &[]).await;
    let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(
        listen_backlog(&gateway.address),
        server::DEFAULT_LISTEN_BACKLOG.min(somaxconn)
    );
}

/// More slow connections than the process has files for: with 256 files the gateway holds 96
/// connections, and the flood opens hundreds that send half their headers and stop. A good
/// client, on a new connection each time, is answered within a few seconds throughout, and
/// normally once the flood stops; the gateway never runs out of files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_slow_connections_past_the_file_limit_does_not_keep_a_good_client_out() {
    let gateway = GatewayProcess::start(Some(256), &[]).await;
    let address = gateway.address.clone();
    let flood = tokio::spawn(async move {
        let mut held = Vec::new();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(6) {
            for _ in 0..20 {
                if let Ok(mut stream) = TcpStream::connect(&address).await {
                    let _ = stream
                        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
                        .await;
                    held.push(stream);
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        held.len()
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut during = Vec::new();
    while !flood.is_finished() {
        during.push(gateway.call().await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let opened = flood.await.unwrap();
    assert!(opened > 500, "the flood opened only {opened} connections");
    assert!(during.len() >= 10, "{during:?}");
    for (status, took) in &during {
        assert_eq!(*status, 200, "a good call during the flood: {during:?}");
        assert!(*took < Duration::from_secs(3), "{during:?}");
    }
    for _ in 0..5 {
        assert_eq!(gateway.call().await.0, 200);
    }
    let log = gateway.log();
    assert!(!log.contains("Too many open files"), "{log}");
    let resident = resident_kib(gateway.child.id());
    eprintln!(
        "flood: {opened} slow connections opened, {} good calls during it (slowest {:?}), gateway resident {} KiB",
        during.len(),
        during.iter().map(|(_, took)| *took).max().unwrap(),
        resident
    );
    assert!(resident < 200 * 1024, "resident memory grew past 200 MiB");
}

/// Many clients send large bodies at once and stall: the bodies held in memory stay within the
/// budget (16 MiB here), those that find no room are answered 503 with a detail, and resident
/// memory shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_large_bodies_at_once_stay_within_the_memory_budget() {
    let gateway = GatewayProcess::start(
        None,
        &[
            ("GATEWAY_BODY_BUDGET_BYTES", "16777216"),
            ("GATEWAY_MAX_BODY_BYTES", "8388608"),
            ("GATEWAY_BODY_IDLE_TIMEOUT_SECS", "2"),
        ],
    )
    .await;
    let idle = resident_kib(gateway.child.id());
    const CLIENTS: usize = 40;
    let sent = 6 * 1024 * 1024;
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let (address, key) = (gateway.address.clone(), gateway.key.clone());
        clients.push(tokio::spawn(async move {
            let stream = TcpStream::connect(&address).await.unwrap();
            let (mut reading, mut writing) = stream.into_split();
            let head = head(&key, "content-length: 8388608\r\n");
            let writer = tokio::spawn(async move {
                let _ = writing.write_all(head.as_bytes()).await;
                let _ = writing.write_all(&vec![b' '; sent]).await;
                // Then stall, holding the connection open.
                tokio::time::sleep(Duration::from_secs(30)).await;
                drop(writing);
            });
            let mut response = Vec::new();
            let mut buffer = [0u8; 4096];
            while !response.ends_with(b"}") {
                match tokio::time::timeout(Duration::from_secs(15), reading.read(&mut buffer)).await
                {
                    Ok(Ok(read)) if read > 0 => response.extend_from_slice(&buffer[..read]),
                    _ => break,
                }
            }
            writer.abort();
            status_and_detail(&String::from_utf8_lossy(&response))
        }));
    }
    // While the bodies arrive and stall, sample the gateway's memory.
    let mut peak = 0;
    for _ in 0..30 {
        peak = peak.max(resident_kib(gateway.child.id()));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut answers = Vec::new();
    for client in clients {
        answers.push(client.await.unwrap());
    }
    let busy = answers.iter().filter(|(status, _)| *status == 503).count();
    let timed_out = answers.iter().filter(|(status, _)| *status == 408).count();
    assert_eq!(busy + timed_out, CLIENTS, "{answers:?}");
    assert!(busy >= CLIENTS / 2, "{answers:?}");
    assert!(
        answers
            .iter()
            .filter(|(status, _)| *status == 503)
            .all(|(_, detail)| detail == "服务繁忙, 请稍后重试"),
        "{answers:?}"
    );
    let grown = peak.saturating_sub(idle) / 1024;
    eprintln!(
        "budget: {busy} x 503, {timed_out} x 408, resident {idle} KiB idle, {peak} KiB at most"
    );
    assert!(
        grown < 64,
        "resident memory grew by {grown} MiB for {CLIENTS} stalled 6 MiB bodies"
    );
    assert_eq!(
        gateway.call().await.0,
        200,
        "the gateway serves normally afterwards"
    );
}
