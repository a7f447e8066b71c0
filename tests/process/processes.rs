//! The example gateway as real processes (`cargo test` builds the examples before running
//! tests): killed with SIGKILL mid-call and restarted, and two of them sharing one `PostgreSQL`
//! under many clients while the provider fails a random share of calls.

use crate::common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::fake_provider::{FakeProvider, Fault};
use common::*;
use model_gateway::{CallLog, KeyStore, SeaOrmStore, keys::KeyHash, store::CallStatus};
use sea_orm::ConnectionTrait;

struct Env {
    vars: Vec<(&'static str, String)>,
}

impl Env {
    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(gateway_binary());
        command
            .args(args)
            .envs(self.vars.iter().map(|(k, v)| (*k, v.as_str())));
        command
    }

    /// Runs a command that must fail: its stderr.
    fn refused(&self, args: &[&str]) -> String {
        let output = self.command(args).output().unwrap();
        assert!(!output.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&output.stderr).into_owned()
    }

    fn run(&self, args: &[&str]) -> (bool, String) {
        let output = self
            .command(args)
            .stderr(Stdio::inherit())
            .output()
            .unwrap();
        (
            output.status.success(),
            String::from_utf8(output.stdout).unwrap(),
        )
    }

    /// A new key with `credits` (`--subscription` or `--topup`) in `bucket`, made by the CLI.
    fn create_key(&self, bucket: &str, credits: &str) -> String {
        let (created, stdout) = self.run(&["keys", "create", bucket, credits]);
        assert!(created);
        stdout.lines().last().unwrap().to_owned()
    }

    /// `serve`, its log (stderr) written to `log`.
    fn serve_logged_to(&self, log: &std::path::Path) -> Child {
        self.command(&["serve"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap()
    }

    fn serve(&self) -> Child {
        self.command(&["serve"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    }
}

/// A gateway on a `SQLite` file in `dir`, its one model served by `provider` (with `extra`
/// settings): its settings, its address and its database URL.
fn sqlite_gateway(
    dir: &std::path::Path,
    provider: &FakeProvider,
    extra: &[(&'static str, &str)],
) -> (Env, String, String) {
    let models = dir.join("models.toml");
    std::fs::write(
        &models,
        one_upstream_toml("slow", &provider.base, "SLOW_KEY", ""),
    )
    .unwrap();
    let listen = free_address();
    let database_url = format!("sqlite://{}?mode=rwc", dir.join("gateway.db").display());
    let mut vars = vec![
        ("DATABASE_URL", database_url.clone()),
        ("GATEWAY_MODELS", models.display().to_string()),
        ("GATEWAY_LISTEN", listen.clone()),
        ("SLOW_KEY", "provider-key".into()),
        ("RUST_LOG", "warn".into()),
    ];
    vars.extend(
        extra
            .iter()
            .map(|(name, value)| (*name, (*value).to_owned())),
    );
    (Env { vars }, listen, database_url)
}

/// Two gateway processes with these settings, each on an address of its own, once both listen.
async fn serve_two(vars: &[(&'static str, String)]) -> ([String; 2], Vec<Child>) {
    let addresses = [free_address(), free_address()];
    let servers = addresses
        .iter()
        .map(|listen| {
            let mut vars = vars.to_vec();
            vars.push(("GATEWAY_LISTEN", listen.clone()));
            vars.push(("RUST_LOG", "error".into()));
            Env { vars }.serve()
        })
        .collect();
    for listen in &addresses {
        listening(listen).await;
    }
    (addresses, servers)
}

/// The URL a gateway process uses for the test's own `PostgreSQL` schema.
fn pg_process_url(db: &TestDb) -> String {
    let separator = if db.url.contains('?') { '&' } else { '?' };
    format!(
        "{}{separator}options=-c%20search_path%3D{}",
        db.url,
        db.pg_schema().unwrap()
    )
}

/// Calls held open at a slow provider, `count` of them, one client each, through `listen`.
fn call_slowly(client: &reqwest::Client, listen: &str, key: &str, count: usize) {
    for _ in 0..count {
        let (client, url, key) = (
            client.clone(),
            format!("http://{listen}{CHAT}"),
            key.to_owned(),
        );
        tokio::spawn(async move {
            client
                .post(url)
                .bearer_auth(key)
                .body(chat_body(CHAT_MODEL))
                .send()
                .await
        });
    }
}

/// How many of the account's calls are still `pending`.
async fn pending_calls(store: &SeaOrmStore, key: &str) -> usize {
    let account = store
        .caller_for_key(&KeyHash::of(key))
        .await
        .unwrap()
        .unwrap()
        .account;
    let calls = store.recent_calls(account, 1000).await.unwrap();
    calls
        .iter()
        .filter(|c| c.status == CallStatus::Pending)
        .count()
}

/// Killed under load and restarted at once, on a `SQLite` file served shared (reservations in
/// the database) and with no recovery age set: the restarted gateway sees that its
/// predecessor's lease holder is gone and refunds its calls before it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_cut_by_a_sigkill_are_refunded_within_seconds_of_the_restart() {
    const IN_FLIGHT: usize = 30;
    let provider = FakeProvider::start().await;
    provider.always(Fault::json(200, r#"{"usage":{}}"#).after(Duration::from_secs(60)));
    let dir = tempfile::tempdir().unwrap();
    let shared = [("GATEWAY_SQLITE_SHARED", "1")];
    let (env, listen, database_url) = sqlite_gateway(dir.path(), &provider, &shared);
    let key = env.create_key("--subscription", "100");

    let mut server = env.serve();
    let client = reqwest::Client::new();
    listening(&listen).await;
    call_slowly(&client, &listen, &key, IN_FLIGHT);
    let store = SeaOrmStore::connect(&database_url).await.unwrap();
    wait_for("the reservations", async || {
        pending_calls(&store, &key).await == IN_FLIGHT
    })
    .await;

    server.kill().unwrap(); // SIGKILL: no chance to refund anything
    server.wait().unwrap();
    let (audited, _) = env.run(&["audit"]);
    assert!(
        audited,
        "pending calls count as charged, so the books balance even now"
    );
    let charged = 100 - CHAT_PRICE * IN_FLIGHT as i64;
    assert_eq!(
        env.run(&["balance", "--key", &key]).1.trim(),
        format!(
            r#"{{"subscription":{charged},"topup":0,"total":{charged},"subscription_ends_at":null}}"#
        )
    );

    let restarted_at = Instant::now();
    let mut restarted = env.serve();
    wait_for("recovery at start", async || {
        pending_calls(&store, &key).await == 0
    })
    .await;
    let credits_back = restarted_at.elapsed();
    let (audited, report) = env.run(&["audit"]);
    let audit_clean = restarted_at.elapsed();
    restarted.kill().unwrap();
    restarted.wait().unwrap();
    println!(
        "{IN_FLIGHT} calls cut by SIGKILL: credits back {credits_back:?} after the restart, audit clean {audit_clean:?} after it"
    );
    assert!(audited, "{report}");
    assert!(report.contains("audit passed: 1 accounts"), "{report}");
    assert!(
        audit_clean < Duration::from_secs(10),
        "credits came back {credits_back:?} and the audit was clean {audit_clean:?} after the restart"
    );

    let account = store
        .caller_for_key(&KeyHash::of(&key))
        .await
        .unwrap()
        .unwrap()
        .account;
    let calls = store.recent_calls(account, 100).await.unwrap();
    assert_eq!(calls.len(), IN_FLIGHT);
    assert!(calls.iter().all(|c| c.status == CallStatus::Refunded));
    assert!(calls.iter().all(|c| {
        c.upstream_error
            .as_deref()
            .unwrap()
            .starts_with("recovered: the gateway instance serving it stopped")
    }));
    assert_eq!(
        env.run(&["balance", "--key", &key]).1.trim(),
        r#"{"subscription":100,"topup":0,"total":100,"subscription_ends_at":null}"#
    );
}

/// The gateway owns its `SQLite` file by default: its reservations are held in memory. While it
/// serves, the CLI's grants and revocations apply to its next calls and a second gateway on the
/// file is refused; killed with calls in flight, it leaves nothing written for them (no entry,
/// no credit moved), so the restarted gateway has nothing to recover and the books balance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owned_files_calls_cut_by_a_sigkill_leave_nothing_to_recover() {
    const IN_FLIGHT: usize = 20;
    let provider = FakeProvider::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (env, listen, database_url) = sqlite_gateway(dir.path(), &provider, &[]);
    let key = env.create_key("--topup", "100");
    let mut server = env.serve();
    let client = reqwest::Client::new();
    listening(&listen).await;
    let url = format!("http://{listen}{CHAT}");
    let call = async |key: &str| chat_status(&client, &url, key).await;

    // A second gateway on the same file is refused at start.
    let second = env
        .command(&["serve"])
        .env("GATEWAY_LISTEN", free_address())
        .output()
        .unwrap();
    assert!(!second.status.success());
    let said = String::from_utf8_lossy(&second.stderr);
    assert!(said.contains("another gateway owns"), "{said}");

    // Grants and revocations made by the CLI while it serves apply to its next calls.
    provider.always(Fault::json(200, r#"{"usage":{}}"#));
    let poor = env.create_key("--topup", "0");
    assert_eq!(call(&poor).await, 402);
    let store = SeaOrmStore::connect(&database_url).await.unwrap();
    let poor_account = store
        .caller_for_key(&KeyHash::of(&poor))
        .await
        .unwrap()
        .unwrap()
        .account
        .0
        .to_string();
    let grant = [
        "grants",
        "add",
        "--account",
        &poor_account,
        "--bucket",
        "topup",
        "--credits",
        "10",
    ];
    assert!(env.run(&grant).0);
    assert_eq!(call(&poor).await, 200);
    let (revoked, _) = env.run(&["keys", "revoke", "--key", &poor]);
    assert!(revoked);
    assert_eq!(call(&poor).await, 401);

    // Calls in flight when the gateway is killed: held, never written.
    provider.always(Fault::json(200, r#"{"usage":{}}"#).after(Duration::from_secs(60)));
    call_slowly(&client, &listen, &key, IN_FLIGHT);
    wait_for("the calls to reach the provider", async || {
        // One earlier call reached it, then these.
        provider.requests() > IN_FLIGHT
    })
    .await;
    assert_eq!(pending_calls(&store, &key).await, 0, "held, not written");
    server.kill().unwrap();
    server.wait().unwrap();

    let full = r#"{"subscription":0,"topup":100,"total":100,"subscription_ends_at":null}"#;
    assert_eq!(env.run(&["balance", "--key", &key]).1.trim(), full);
    let (audited, report) = env.run(&["audit"]);
    assert!(audited, "{report}");
    let (recovered, report) = env.run(&["recover"]);
    assert!(recovered);
    assert!(
        report.contains("refunded 0 reservations of stopped instances and 0 stale"),
        "nothing to recover: {report}"
    );
    let account = store
        .caller_for_key(&KeyHash::of(&key))
        .await
        .unwrap()
        .unwrap()
        .account;
    assert!(store.recent_calls(account, 100).await.unwrap().is_empty());

    // Restarted, it serves and bills as before.
    let mut restarted = env.serve();
    listening(&listen).await;
    provider.always(Fault::json(200, r#"{"usage":{}}"#));
    assert_eq!(call(&key).await, 200);
    restarted.kill().unwrap();
    restarted.wait().unwrap();
    let calls = store.recent_calls(account, 100).await.unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].status, CallStatus::Ok);
    let (audited, report) = env.run(&["audit"]);
    assert!(audited, "{report}");
}

/// Two gateways on the test's `PostgreSQL` schema with `lease_secs` leases and `extra`
/// settings, calling a provider that answers after a minute.
struct SlowPair {
    addresses: [String; 2],
    servers: Vec<Child>,
    database_url: String,
    _provider: FakeProvider,
    _dir: tempfile::TempDir,
}

impl SlowPair {
    async fn start(db: &TestDb, lease_secs: u64, extra: &[(&'static str, String)]) -> SlowPair {
        let provider = FakeProvider::start().await;
        provider.always(Fault::json(200, r#"{"usage":{}}"#).after(Duration::from_secs(60)));
        let dir = tempfile::tempdir().unwrap();
        let models = dir.path().join("models.toml");
        std::fs::write(
            &models,
            one_upstream_toml("slow", &provider.base, "SLOW_KEY", ""),
        )
        .unwrap();
        let database_url = pg_process_url(db);
        let mut vars = vec![
            ("DATABASE_URL", database_url.clone()),
            ("GATEWAY_MODELS", models.display().to_string()),
            ("GATEWAY_LEASE_SECS", lease_secs.to_string()),
            ("SLOW_KEY", "provider-key".into()),
        ];
        vars.extend_from_slice(extra);
        let (addresses, servers) = serve_two(&vars).await;
        SlowPair {
            addresses,
            servers,
            database_url,
            _provider: provider,
            _dir: dir,
        }
    }
}

/// Two gateways on one `PostgreSQL`, each serving slow calls; one is killed. The other refunds
/// the dead one's reservations once its lease has expired (within the lease plus a heartbeat),
/// and none of its own, however long they last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instances_reservations_are_refunded_by_its_peer_and_only_those() {
    const LEASE_SECS: u64 = 3;
    const EACH: usize = 5;
    let Some(db) = postgres_db().await else {
        return;
    };
    let slow = SlowPair::start(&db, LEASE_SECS, &[]).await;
    let (addresses, mut servers, database_url) = (slow.addresses, slow.servers, slow.database_url);
    // One account per gateway, so that each one's calls can be told apart.
    let killed_key = db.funded_key(100, 0).await;
    let surviving_key = db.funded_key(100, 0).await;
    let client = reqwest::Client::new();
    call_slowly(&client, &addresses[0], &killed_key, EACH);
    call_slowly(&client, &addresses[1], &surviving_key, EACH);
    wait_for("the reservations", async || {
        pending_calls(&db.store, &killed_key).await == EACH
            && pending_calls(&db.store, &surviving_key).await == EACH
    })
    .await;

    servers[0].kill().unwrap();
    servers[0].wait().unwrap();
    let killed_at = Instant::now();
    wait_for("the peer's recovery", async || {
        pending_calls(&db.store, &killed_key).await == 0
    })
    .await;
    let refunded_after = killed_at.elapsed();
    // Past two more leases, the survivor's own calls are still being served.
    tokio::time::sleep(Duration::from_secs(2 * LEASE_SECS)).await;
    let survivors_pending = pending_calls(&db.store, &surviving_key).await;
    servers[1].kill().unwrap();
    servers[1].wait().unwrap();
    println!(
        "lease {LEASE_SECS}s: the killed instance's {EACH} reservations refunded {refunded_after:?} after the kill"
    );

    let heartbeat = Duration::from_secs(LEASE_SECS) / 5;
    // The lease was renewed at most a heartbeat before the kill; polling adds 100 ms.
    assert!(
        refunded_after <= Duration::from_secs(LEASE_SECS) + heartbeat + Duration::from_millis(500),
        "refunded {refunded_after:?} after the kill"
    );
    assert!(
        refunded_after >= Duration::from_secs(LEASE_SECS) - heartbeat - Duration::from_millis(200),
        "refunded {refunded_after:?} after the kill: before the lease could have expired"
    );
    assert_eq!(
        survivors_pending, EACH,
        "the live instance's calls were touched"
    );
    assert_eq!(db.balance(&killed_key).await, balance(100, 0));
    let env = Env {
        vars: vec![("DATABASE_URL", database_url)],
    };
    let (audited, report) = env.run(&["audit"]);
    assert!(audited, "{report}");
    db.drop_schema().await;
}

/// The account's credits in escrow, summed over its escrow rows.
async fn escrowed(db: &TestDb, key: &str) -> i64 {
    let account = db.account(key).await.0;
    let row = db
        .store
        .connection()
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::Postgres,
            format!(
                "SELECT CAST(COALESCE(SUM(subscription_credits + topup_credits), 0) AS BIGINT) \
                 FROM mg_escrows WHERE account_id = {account}"
            ),
        ))
        .await
        .unwrap()
        .unwrap();
    row.try_get_by_index::<i64>(0).unwrap()
}

/// Two gateways on one `PostgreSQL` charging against escrow (`GATEWAY_PG_ESCROW=1`), each
/// holding slow calls in memory; one is killed. Its calls were never written, and once its
/// lease has expired the other gives its escrow back: the account is whole, with nothing to
/// refund, and the survivor's escrow is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_escrow_instances_credits_come_back_through_its_peer() {
    const LEASE_SECS: u64 = 3;
    const EACH: usize = 5;
    const CREDITS: i64 = 10_000;
    let Some(db) = postgres_db().await else {
        return;
    };
    let slow = SlowPair::start(&db, LEASE_SECS, &[("GATEWAY_PG_ESCROW", "1".into())]).await;
    let (addresses, mut servers, database_url) = (slow.addresses, slow.servers, slow.database_url);
    let killed_key = db.funded_key(CREDITS, 0).await;
    let surviving_key = db.funded_key(CREDITS, 0).await;
    let client = reqwest::Client::new();
    call_slowly(&client, &addresses[0], &killed_key, EACH);
    call_slowly(&client, &addresses[1], &surviving_key, EACH);
    // Held calls are seen by no other process; their escrow is.
    wait_for("the calls to be held", async || {
        escrowed(&db, &killed_key).await > 0 && escrowed(&db, &surviving_key).await > 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        pending_calls(&db.store, &killed_key).await,
        0,
        "held, not written"
    );

    servers[0].kill().unwrap();
    servers[0].wait().unwrap();
    let killed_at = Instant::now();
    wait_for("the peer's recovery", async || {
        escrowed(&db, &killed_key).await == 0
    })
    .await;
    let given_back_after = killed_at.elapsed();
    tokio::time::sleep(Duration::from_secs(2 * LEASE_SECS)).await;
    let survivors_escrow = escrowed(&db, &surviving_key).await;
    servers[1].kill().unwrap();
    servers[1].wait().unwrap();
    println!(
        "lease {LEASE_SECS}s: the killed instance's escrow given back {given_back_after:?} after the kill"
    );
    let heartbeat = Duration::from_secs(LEASE_SECS) / 5;
    assert!(
        given_back_after
            <= Duration::from_secs(LEASE_SECS) + heartbeat + Duration::from_millis(500),
        "given back {given_back_after:?} after the kill"
    );
    assert!(
        given_back_after
            >= Duration::from_secs(LEASE_SECS) - heartbeat - Duration::from_millis(200),
        "given back {given_back_after:?} after the kill: before the lease could have expired"
    );
    assert!(survivors_escrow > 0, "the live instance's escrow was taken");
    assert_eq!(db.balance(&killed_key).await, balance(CREDITS, 0));
    assert!(
        db.calls(&killed_key).await.is_empty(),
        "nothing billed, nothing to refund"
    );
    let env = Env {
        vars: vec![("DATABASE_URL", database_url)],
    };
    let (audited, report) = env.run(&["audit"]);
    assert!(audited, "{report}");
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateway_processes_on_one_postgres_spend_exactly_the_credits_there_are() {
    let Some(db) = postgres_db().await else {
        return;
    };
    const AFFORDABLE: i64 = 40;
    let key = db
        .funded_key(AFFORDABLE * CHAT_PRICE / 2, AFFORDABLE * CHAT_PRICE / 2)
        .await;
    let provider = FakeProvider::start().await;
    let reply = Fault::json(
        200,
        r#"{"usage":{"prompt_tokens":1,"completion_tokens":1}}"#,
    );
    provider.always(Fault::OneOf(vec![
        reply.clone(),
        reply,
        Fault::json(500, r#"{"error":{"message":"flaky"}}"#),
        Fault::Reset,
    ]));
    let dir = tempfile::tempdir().unwrap();
    let models = dir.path().join("models.toml");
    std::fs::write(
        &models,
        one_upstream_toml(
            "flaky",
            &provider.base,
            "FLAKY_KEY",
            "breaker_failures = 1000",
        ),
    )
    .unwrap();
    let database_url = pg_process_url(&db);
    let (addresses, mut servers) = serve_two(&[
        ("DATABASE_URL", database_url.clone()),
        ("GATEWAY_MODELS", models.display().to_string()),
        ("FLAKY_KEY", "provider-key".into()),
    ])
    .await;

    // 16 clients call until each is told 402.
    let client = reqwest::Client::new();
    let clients: Vec<_> = (0..16)
        .map(|i| {
            let (client, key) = (client.clone(), key.clone());
            let url = format!("http://{}{CHAT}", addresses[i % 2]);
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                loop {
                    let status = chat_status(&client, &url, &key).await;
                    statuses.push(status);
                    if status == 402 || statuses.len() > 500 {
                        return statuses;
                    }
                }
            })
        })
        .collect();
    let mut count = std::collections::BTreeMap::<u16, i64>::new();
    for client in clients {
        for status in client.await.unwrap() {
            *count.entry(status).or_default() += 1;
        }
    }
    for server in &mut servers {
        server.kill().unwrap();
        server.wait().unwrap();
    }

    assert!(
        count.keys().all(|s| [200, 402, 502].contains(s)),
        "{count:?}"
    );
    assert_eq!(count.get(&200), Some(&AFFORDABLE), "{count:?}");
    assert_eq!(count.get(&402), Some(&16));
    assert!(
        count.get(&502).copied().unwrap_or(0) > 0,
        "the provider failed no call: {count:?}"
    );
    let calls = db.calls(&key).await;
    let with = |status| calls.iter().filter(|c| c.status == status).count() as i64;
    assert_eq!(with(CallStatus::Ok), AFFORDABLE);
    assert_eq!(with(CallStatus::Refunded), count[&502]);
    assert_eq!(with(CallStatus::Pending), 0);
    assert_eq!(db.balance(&key).await, balance(0, 0));
    let env = Env {
        vars: vec![("DATABASE_URL", database_url.clone())],
    };
    let (audited, report) = env.run(&["audit"]);
    assert!(audited, "{report}");
    db.drop_schema().await;
}

/// The operator's commands refuse credits past the largest balance with a clear message and a
/// non-zero exit, and write nothing, however the amounts are split between the buckets.
#[tokio::test]
async fn credit_commands_past_the_largest_balance_fail_clearly_and_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env {
        vars: vec![(
            "DATABASE_URL",
            format!(
                "sqlite://{}?mode=rwc",
                dir.path().join("gateway.db").display()
            ),
        )],
    };
    let max = i64::MAX.to_string();
    // Its error read here rather than passed to the test's own stderr, where a passing run
    // showed it as a stray `error:` line.
    let error = env.refused(&["keys", "create", "--subscription", &max, "--topup", "1"]);
    assert!(
        error.contains("largest value a balance can hold"),
        "{error}"
    );
    let (created, out) = env.run(&["keys", "create", "--topup", &max]);
    assert!(created, "{out}");
    let key = out.lines().last().unwrap().to_owned();
    for args in [["--topup", "1"], ["--subscription", "1"]] {
        let error = env.refused(&["credits", "add", "--key", &key, args[0], args[1]]);
        assert!(
            error.contains("largest value a balance can hold"),
            "{error}"
        );
    }
    let (_, balance) = env.run(&["balance", "--key", &key]);
    let balance: serde_json::Value = serde_json::from_str(&balance).unwrap();
    assert_eq!(balance["topup"], i64::MAX);
    assert_eq!(balance["subscription"], 0);
    let (audited, report) = env.run(&["audit"]);
    assert!(audited, "{report}");
    assert!(report.contains("audit passed: 1 accounts"), "{report}");
}

/// Serves the gateway binary (real providers, none reachable) with `format` as its log format,
/// makes one call that fails upstream with the request id `trace-me-42`, and returns the log.
async fn log_of_a_failed_call(format: Option<&str>) -> String {
    let dir = tempfile::tempdir().unwrap();
    let listen = free_address();
    let mut vars = vec![
        (
            "DATABASE_URL",
            format!(
                "sqlite://{}?mode=rwc",
                dir.path().join("gateway.db").display()
            ),
        ),
        ("GATEWAY_LISTEN", listen.clone()),
        ("OPENAI_API_KEY", String::new()), // so the provider fails without being called
    ];
    if let Some(format) = format {
        vars.push(("GATEWAY_LOG_FORMAT", format.to_owned()));
    }
    let env = Env { vars };
    let key = env.create_key("--subscription", "10");
    let log = dir.path().join("gateway.log");
    let mut server = env.serve_logged_to(&log);
    listening(&listen).await;
    let answer = reqwest::Client::new()
        .post(format!("http://{listen}{CHAT}"))
        .bearer_auth(&key)
        .header("x-request-id", "trace-me-42")
        .body(chat_body(CHAT_MODEL))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 502);
    assert_eq!(answer.headers()["x-request-id"], "trace-me-42");
    server.kill().unwrap();
    server.wait().unwrap();
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(!log.contains(&key), "a key reached the log");
    log
}

/// The server's log lines for a request name its id, so an operator can find a client's failed
/// call from the id in its answer; written to a file, they carry no colour codes.
#[tokio::test]
async fn the_log_lines_of_a_request_carry_its_id() {
    let log = log_of_a_failed_call(None).await;
    assert!(!log.contains('\x1b'), "colour codes in a log file: {log}");
    let line = log
        .lines()
        .find(|line| line.contains("upstream failed"))
        .unwrap_or_else(|| panic!("no refund warning in {log}"));
    assert!(line.contains("request_id=trace-me-42"), "{line}");
    assert_eq!(line.matches("trace-me-42").count(), 1, "{line}");
}

/// `GATEWAY_LOG_FORMAT=json`: one JSON object per line, the request id in the request's span.
#[tokio::test]
async fn json_log_lines_are_objects_with_the_request_id() {
    let log = log_of_a_failed_call(Some("json")).await;
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|_| panic!("not JSON: {line}")))
        .collect();
    let refund = lines
        .iter()
        .find(|line| line["fields"]["message"] == "upstream failed; refunding")
        .unwrap_or_else(|| panic!("no refund warning in {log}"));
    assert_eq!(refund["span"]["request_id"], "trace-me-42", "{refund}");
    assert_eq!(refund["level"], "WARN");
    // One access line per request with what an operator looks for.
    let access: Vec<_> = lines
        .iter()
        .filter(|line| line["target"] == "model_gateway::access")
        .collect();
    assert_eq!(access.len(), 1, "{log}");
    let fields = &access[0]["fields"];
    assert_eq!(fields["request_id"], "trace-me-42", "{fields}");
    assert_eq!(fields["method"], "POST");
    assert_eq!(fields["path"], CHAT);
    assert_eq!(fields["status"], 502);
    assert_eq!(fields["model"], CHAT_MODEL);
    assert_eq!(fields["outcome"], "refunded");
    assert_eq!(fields["credits"], 0);
    assert_eq!(fields["error"], "upstream_unavailable");
    assert!(fields["duration_ms"].is_f64(), "{fields}");
    let key = fields["key"].as_str().unwrap();
    assert!(key.starts_with("sk-mg-") && key.len() == 12, "{fields}");
}

/// One request of the access-log run: what is sent, and the status its line must say.
struct Sent {
    id: String,
    status: u16,
}

/// Serves the gateway binary in mock mode with streaming on and `format` as its log format,
/// sends refused, plain and streamed calls (each with a request id of its own), stops it
/// gracefully, and returns what was sent, the key used and the log.
async fn access_log_run(format: &str) -> (Vec<Sent>, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let listen = free_address();
    let env = Env {
        vars: vec![
            (
                "DATABASE_URL",
                format!(
                    "sqlite://{}?mode=rwc",
                    dir.path().join("gateway.db").display()
                ),
            ),
            ("GATEWAY_LISTEN", listen.clone()),
            ("MOCK_UPSTREAM", "1".into()),
            ("GATEWAY_STREAMING", "1".into()),
            ("GATEWAY_LOG_FORMAT", format.to_owned()),
        ],
    };
    let key = env.create_key("--subscription", "100");
    let poor = env.create_key("--subscription", "1");
    let log = dir.path().join("gateway.log");
    let mut server = env.serve_logged_to(&log);
    listening(&listen).await;
    let client = reqwest::Client::new();
    let base = format!("http://{listen}");
    let stream_chat = r#"{"model":"gpt-4o-mini","messages":[],"stream":true}"#;
    let stream_messages =
        r#"{"model":"claude-haiku-4-5","max_tokens":8,"messages":[],"stream":true}"#;
    let responses = r#"{"model":"gpt-4o-mini","input":"Hi"}"#;
    let requests: Vec<(&str, &str, &str, String, u16)> = vec![
        ("POST", CHAT, "sk-mg-wrong", chat_body(CHAT_MODEL), 401),
        ("POST", CHAT, &key, "not json".into(), 400),
        ("POST", CHAT, &poor, chat_body(CHAT_MODEL), 402),
        ("POST", MESSAGES, &key, messages_body("no-such-model"), 404),
        ("GET", CHAT, &key, String::new(), 405),
        ("POST", "/v1/no-such-path", &key, "{}".into(), 404),
        ("POST", CHAT, &key, chat_body(CHAT_MODEL), 200),
        (
            "POST",
            MESSAGES,
            &key,
            messages_body("claude-haiku-4-5-20251001"),
            200,
        ),
        ("POST", CHAT, &key, stream_chat.into(), 200),
        ("POST", MESSAGES, &key, stream_messages.into(), 200),
        ("POST", "/v1/responses", &key, responses.into(), 200),
        ("POST", "/v1/responses", &poor, responses.into(), 402),
    ];
    let mut sent = Vec::new();
    for (n, (method, path, with_key, body, status)) in requests.into_iter().enumerate() {
        let id = format!("access-{n:02}");
        let answer = client
            .request(method.parse().unwrap(), format!("{base}{path}"))
            .header("x-api-key", with_key)
            .header("x-request-id", &id)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status().as_u16(), status, "{id}");
        assert_eq!(answer.headers()["request-id"], id.as_str());
        // A stream's line is written at its end: read it whole.
        answer.bytes().await.unwrap();
        sent.push(Sent { id, status });
    }
    // A graceful stop, so that every line is out.
    let stopped = Command::new("kill")
        .args(["-INT", &server.id().to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    assert!(server.wait().unwrap().success());
    let log = std::fs::read_to_string(&log).unwrap();
    (sent, key, log)
}

/// Every request, refused ones and streams included, has exactly one access line, which
/// names its id and its status; the key appears in none, only its display prefix.
#[tokio::test]
async fn the_access_log_has_one_line_per_request_with_its_id_and_status() {
    let (sent, key, log) = access_log_run("text").await;
    let access: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("model_gateway::access"))
        .collect();
    assert_eq!(access.len(), sent.len(), "{log}");
    for Sent { id, status } in &sent {
        let lines: Vec<_> = access
            .iter()
            .filter(|line| line.contains(&format!("request_id=\"{id}\"")))
            .collect();
        assert_eq!(lines.len(), 1, "{id}: {log}");
        assert!(
            lines[0].contains(&format!(" status={status} ")),
            "{}",
            lines[0]
        );
    }
    let alias = access
        .iter()
        .find(|line| line.contains("request_id=\"access-07\""))
        .unwrap();
    assert!(
        alias.contains("model=\"claude-haiku-4-5\"")
            && alias.contains("requested_model=\"claude-haiku-4-5-20251001\"")
            && alias.contains("outcome=\"ok\" credits=3"),
        "{alias}"
    );
    assert!(
        alias.contains(&format!("key=\"{}\"", &key[..12])),
        "{alias}"
    );
    assert!(!log.contains(&key), "a key reached the log");
}

/// The same in JSON: one object per access line, its fields those of the request.
#[tokio::test]
async fn the_json_access_log_has_one_object_per_request_with_its_fields() {
    let (sent, key, log) = access_log_run("json").await;
    let access: Vec<serde_json::Value> = log
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|_| panic!("not JSON: {line}")))
        .filter(|line: &serde_json::Value| line["target"] == "model_gateway::access")
        .collect();
    assert_eq!(access.len(), sent.len(), "{log}");
    for Sent { id, status } in &sent {
        let lines: Vec<_> = access
            .iter()
            .filter(|line| line["fields"]["request_id"] == id.as_str())
            .collect();
        assert_eq!(lines.len(), 1, "{id}: {log}");
        assert_eq!(lines[0]["fields"]["status"], *status, "{id}");
        assert!(lines[0]["fields"]["duration_ms"].is_f64(), "{id}");
    }
    let stream = &access
        .iter()
        .find(|line| line["fields"]["request_id"] == "access-09")
        .unwrap()["fields"];
    assert_eq!(stream["model"], MESSAGES_MODEL);
    assert_eq!(stream["outcome"], "ok");
    assert_eq!(stream["credits"], MESSAGES_PRICE);
    let refused = &access
        .iter()
        .find(|line| line["fields"]["request_id"] == "access-02")
        .unwrap()["fields"];
    assert_eq!(refused["error"], "insufficient_credits");
    assert_eq!(
        refused.get("credits"),
        None,
        "a refused call charged nothing"
    );
    // The Responses endpoint's lines, paid and refused, as the other endpoints'.
    let field = |id: &str| {
        access
            .iter()
            .find(|line| line["fields"]["request_id"] == id)
            .unwrap()["fields"]
            .clone()
    };
    let (paid, poor) = (field("access-10"), field("access-11"));
    assert_eq!(paid["path"], "/v1/responses");
    assert_eq!(paid["model"], CHAT_MODEL);
    assert_eq!(paid["outcome"], "ok");
    assert_eq!(paid["credits"], CHAT_PRICE);
    assert_eq!(poor["path"], "/v1/responses");
    assert_eq!(poor["error"], "insufficient_credits");
    assert!(!log.contains(&key), "a key reached the log");
}

/// `SIGHUP` reloads the catalogue from `GATEWAY_MODELS`: a new price serves at once; a bad file
/// is refused (logged) and the old catalogue serves on; the process never stops.
#[tokio::test]
async fn a_hangup_reloads_the_catalogue_and_a_bad_file_leaves_it_serving() {
    let dir = tempfile::tempdir().unwrap();
    let provider = FakeProvider::start().await;
    provider.always(Fault::json(
        200,
        r#"{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#,
    ));
    let (env, listen, _) = sqlite_gateway(dir.path(), &provider, &[]);
    let models = dir.path().join("models.toml");
    let key = env.create_key("--subscription", "100");
    let log = dir.path().join("gateway.log");
    let mut server = env.serve_logged_to(&log);
    listening(&listen).await;
    let client = reqwest::Client::new();
    let charged = async || {
        let answer = client
            .post(format!("http://{listen}{CHAT}"))
            .bearer_auth(&key)
            .body(chat_body(CHAT_MODEL))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200);
        answer.headers()["x-gateway-credits"]
            .to_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(charged().await, CHAT_PRICE.to_string());
    let hang_up = || {
        let sent = Command::new("kill")
            .args(["-HUP", &server.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    };
    let repriced = one_upstream_toml("slow", &provider.base, "SLOW_KEY", "")
        .replace(&format!("price = {CHAT_PRICE}"), "price = 9");
    std::fs::write(&models, &repriced).unwrap();
    hang_up();
    wait_for("the new price to serve", async || charged().await == "9").await;
    std::fs::write(&models, "[[models]]\nname = \"broken\"\n").unwrap();
    hang_up();
    wait_for("the refusal to be logged", async || {
        std::fs::read_to_string(&log)
            .unwrap()
            .contains("catalogue refused")
    })
    .await;
    assert_eq!(charged().await, "9", "the old catalogue serves on");
    assert!(server.try_wait().unwrap().is_none(), "the gateway runs on");
    server.kill().unwrap();
    server.wait().unwrap();
}

/// Accepted webhook deliveries: each event, and whether its signature held.
type Accepted = std::sync::Arc<std::sync::Mutex<Vec<(serde_json::Value, bool)>>>;

/// A webhook receiver over real HTTP checking each delivery's signature with `secret`: its
/// URL, what it accepted, and how many requests it has had. With `hold_first`, it leaves the
/// first request unanswered for a minute.
async fn webhook_receiver(
    secret: &'static str,
    hold_first: bool,
) -> (
    String,
    Accepted,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let accepted = Accepted::default();
    let requests = std::sync::Arc::new(AtomicUsize::new(0));
    let app = {
        let (accepted, requests) = (accepted.clone(), requests.clone());
        axum::Router::new().route(
            "/hooks",
            axum::routing::post(
                move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                    let (accepted, requests) = (accepted.clone(), requests.clone());
                    async move {
                        if requests.fetch_add(1, Ordering::SeqCst) == 0 && hold_first {
                            tokio::time::sleep(Duration::from_secs(60)).await;
                        }
                        let signature = headers["x-gateway-signature"].to_str().unwrap();
                        let now = chrono::Utc::now().timestamp();
                        let good =
                            model_gateway::events::verify(secret, signature, &body, now, 300);
                        let event = serde_json::from_slice(&body).unwrap();
                        accepted.lock().unwrap().push((event, good));
                        axum::http::StatusCode::OK
                    }
                },
            ),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hooks", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, accepted, requests)
}

/// One redemption code of `credits` top-up credits, made with the example's command line.
fn one_code(env: &Env, credits: &str) -> String {
    let (created, batch) = env.run(&[
        "codes",
        "create",
        "--count",
        "1",
        "--credits",
        credits,
        "--bucket",
        "topup",
    ]);
    assert!(created);
    let batch: serde_json::Value = serde_json::from_str(&batch).unwrap();
    batch["codes"][0].as_str().unwrap().to_owned()
}

/// Redeems `code` with `key` through the gateway at `listen`.
async fn redeem(listen: &str, key: &str, code: &str) {
    let redeemed = reqwest::Client::new()
        .post(format!("http://{listen}/v1/redeem"))
        .bearer_auth(key)
        .json(&serde_json::json!({ "code": code }))
        .send()
        .await
        .unwrap();
    assert_eq!(redeemed.status(), 200);
}

/// A webhook delivery cut by a SIGKILL of its gateway is delivered after the restart, the same
/// event with the same id, signed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_delivery_cut_by_a_sigkill_is_delivered_after_the_restart() {
    let dir = tempfile::tempdir().unwrap();
    // The receiver leaves its first request unanswered; it accepts the later ones.
    let (hooks, seen, requests) = webhook_receiver("whsec_process_0123", true).await;
    let listen = free_address();
    let env = Env {
        vars: vec![
            (
                "DATABASE_URL",
                format!(
                    "sqlite://{}?mode=rwc",
                    dir.path().join("gateway.db").display()
                ),
            ),
            ("GATEWAY_LISTEN", listen.clone()),
            ("MOCK_UPSTREAM", "1".into()),
            ("GATEWAY_WEBHOOK_URL", hooks),
            ("GATEWAY_WEBHOOK_SECRET", "whsec_process_0123".into()),
            ("GATEWAY_WEBHOOK_TIMEOUT_SECS", "2".into()),
            ("RUST_LOG", "error".into()),
        ],
    };
    let key = env.create_key("--topup", "1");
    let code = one_code(&env, "30");
    let mut server = env.serve();
    listening(&listen).await;
    redeem(&listen, &key, &code).await;
    wait_for("the delivery to reach the receiver", async || {
        requests.load(std::sync::atomic::Ordering::SeqCst) == 1
    })
    .await;
    server.kill().unwrap();
    server.wait().unwrap();
    assert!(
        seen.lock().unwrap().is_empty(),
        "nothing was accepted before the kill"
    );

    let mut restarted = env.serve();
    listening(&listen).await;
    wait_for("the event to be delivered after the restart", async || {
        !seen.lock().unwrap().is_empty()
    })
    .await;
    let accepted = seen.lock().unwrap().clone();
    assert_eq!(accepted.len(), 1);
    let id = accepted[0].0["id"].as_str().unwrap();
    assert!(id.starts_with("evt_") && accepted[0].1, "{accepted:?}");
    let (ok, balance) = env.run(&["balance", "--key", &key]);
    assert!(ok);
    let balance: serde_json::Value = serde_json::from_str(&balance).unwrap();
    assert_eq!(balance["topup"], 31, "the code was granted once");
    restarted.kill().unwrap();
    restarted.wait().unwrap();
}

/// The example's settings: `GATEWAY_LOW_BALANCE_CREDITS` sets the threshold, and
/// `GATEWAY_WEBHOOK_EVENTS` the types delivered (a code redeemed is left out here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_low_balance_threshold_and_the_event_types_are_settings() {
    let dir = tempfile::tempdir().unwrap();
    let (hooks, seen, _) = webhook_receiver("whsec_settings_012", false).await;
    let listen = free_address();
    let database = dir.path().join("gateway.db");
    let env = Env {
        vars: vec![
            (
                "DATABASE_URL",
                format!("sqlite://{}?mode=rwc", database.display()),
            ),
            ("GATEWAY_LISTEN", listen.clone()),
            ("MOCK_UPSTREAM", "1".into()),
            ("GATEWAY_WEBHOOK_URL", hooks),
            ("GATEWAY_WEBHOOK_SECRET", "whsec_settings_012".into()),
            (
                "GATEWAY_WEBHOOK_EVENTS",
                "account.balance_low,key.limit_reached".into(),
            ),
            ("GATEWAY_LOW_BALANCE_CREDITS", "5".into()),
            ("RUST_LOG", "error".into()),
        ],
    };
    let key = env.create_key("--topup", "8");
    let code = one_code(&env, "1");
    let mut server = env.serve();
    listening(&listen).await;
    redeem(&listen, &key, &code).await;
    // 9 credits, 2 a call: 7, then 5, then 3 (below 5: told).
    let client = reqwest::Client::new();
    for _ in 0..3 {
        let url = format!("http://{listen}{CHAT}");
        assert_eq!(chat_status(&client, &url, &key).await, 200);
    }
    wait_for("the low balance to be delivered", async || {
        !seen.lock().unwrap().is_empty()
    })
    .await;
    server.kill().unwrap();
    server.wait().unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "only the types asked for: {seen:?}");
    let (event, signed) = &seen[0];
    assert!(signed, "the signature did not hold");
    assert_eq!(event["type"], "account.balance_low");
    assert_eq!(event["data"]["total"], 3);
    assert_eq!(event["data"]["threshold"], 5);
}

/// A webhook URL that names the gateway's own address, a metadata service or a secret too
/// short to sign with is refused at start, naming the setting (the adversarial run: all three
/// were taken).
#[test]
fn a_webhook_to_itself_a_metadata_service_or_with_a_short_secret_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let listen = free_address();
    let database = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("gateway.db").display()
    );
    let own = format!("http://{listen}/admin/accounts");
    let cases = [
        (
            own.as_str(),
            "whsec_0123456789abcdef",
            "this gateway itself",
        ),
        (
            "http://169.254.169.254/latest/",
            "whsec_0123456789abcdef",
            "link-local",
        ),
        (
            "https://billing.example.com/hooks",
            "x",
            "at least 16 characters",
        ),
    ];
    for (url, secret, said) in cases {
        let env = Env {
            vars: vec![
                ("DATABASE_URL", database.clone()),
                ("MOCK_UPSTREAM", "1".into()),
                ("GATEWAY_LISTEN", listen.clone()),
                ("GATEWAY_WEBHOOK_URL", url.to_owned()),
                ("GATEWAY_WEBHOOK_SECRET", secret.to_owned()),
            ],
        };
        let mut child = env
            .command(&["serve"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let started = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > Duration::from_secs(30) {
                child.kill().unwrap();
                panic!("{url} was taken: the gateway served");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut error = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut error).unwrap();
        assert!(!status.success(), "{url}");
        assert!(error.contains(said), "{url}: {error}");
    }
}
