//! Test harness: the example gateway's own router served over real HTTP on an ephemeral port,
//! on a temporary `SQLite` file, a private `PostgreSQL` schema or a private `MariaDB` database.
//!
//! The crate builds with any one database backend alone (`--no-default-features --features
//! postgres,...`), and so do the tests: [`each_database`] runs on the backends the build has,
//! [`local_db`] is the one database a single-database test runs on (the embedded default,
//! `SQLite`, when the build has it), and tests about one backend are compiled with it only.
#![allow(dead_code)]

pub mod db_proxy;
#[cfg(all(feature = "bedrock", feature = "vertex"))]
pub mod fake_cloud;
pub mod fake_provider;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use model_gateway::{
    Accounts, Balance, CallLog, Catalogue, Credits, KeyStore, Ledger, SeaOrmStore, Upstream,
    credits::Bucket, keys::KeyHash, keys::NewApiKey, router::DEFAULT_MAX_BODY_BYTES,
    store::CallRecord, upstream::MockUpstream,
};
use sea_orm::{ConnectOptions, ConnectionTrait, Database};
use serde_json::Value;

/// A database for one test; the `SQLite` file or `PostgreSQL` schema is dropped with it.
pub struct TestDb {
    pub store: Arc<SeaOrmStore>,
    pub url: String,
    _dir: Option<tempfile::TempDir>,
    pg_schema: Option<String>,
    /// For `MySQL`: the server URL without a database, and the test's own database.
    mysql_database: Option<(String, String)>,
}

/// The database a test about the gateway rather than one backend runs on: a temporary
/// `SQLite` file, the embedded default; in a build without `sqlite`, a schema of its own on the
/// test `PostgreSQL`, or else a database of its own on the test `MariaDB` (dropped with it).
/// `TEST_LOCAL_DB=postgres` or `mysql` picks one of those in any build that has it, so CI runs
/// these tests on every backend without building them again.
pub async fn local_db() -> TestDb {
    match std::env::var("TEST_LOCAL_DB").as_deref() {
        #[cfg(feature = "postgres")]
        Ok("postgres") => {
            return postgres_db()
                .await
                .expect("TEST_LOCAL_DB=postgres: set TEST_POSTGRES_URL");
        }
        #[cfg(feature = "mysql")]
        Ok("mysql") => {
            return mysql_db()
                .await
                .expect("TEST_LOCAL_DB=mysql: set TEST_MYSQL_URL");
        }
        Ok(other) if other != "sqlite" => panic!("TEST_LOCAL_DB={other}: not in this build"),
        _ => {}
    }
    #[cfg(feature = "sqlite")]
    return sqlite_db().await;
    #[cfg(all(not(feature = "sqlite"), feature = "postgres"))]
    return postgres_db()
        .await
        .expect("a build without sqlite tests on PostgreSQL: set TEST_POSTGRES_URL");
    #[cfg(all(not(feature = "sqlite"), not(feature = "postgres")))]
    return mysql_db()
        .await
        .expect("a build without sqlite or postgres tests on MariaDB: set TEST_MYSQL_URL");
}

#[cfg(feature = "sqlite")]
pub async fn sqlite_db() -> TestDb {
    sqlite_db_with(|store| store).await
}

/// A temporary `SQLite` file owned by its store: reservations held in memory
/// ([`SeaOrmStore::own_file`]).
#[cfg(feature = "sqlite")]
pub async fn owned_sqlite_db() -> TestDb {
    sqlite_db_with(|store| store.own_file().unwrap()).await
}

#[cfg(feature = "sqlite")]
async fn sqlite_db_with(make: impl FnOnce(SeaOrmStore) -> SeaOrmStore) -> TestDb {
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("gateway.db").display()
    );
    let store = Arc::new(make(SeaOrmStore::connect(&url).await.unwrap()));
    TestDb {
        store,
        url,
        _dir: Some(dir),
        pg_schema: None,
        mysql_database: None,
    }
}

/// A test database URL from `variable`, or `None` to skip. Under CI the variable must be set:
/// a database test silently skipped in CI would be a check that cannot fail.
fn database_url(variable: &'static str) -> Option<String> {
    match std::env::var(variable) {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var_os("CI").is_some() => panic!("{variable} must be set when CI is set"),
        _ => {
            eprintln!("{variable} is not set; skipping this database's part");
            skipped::record(variable);
            None
        }
    }
}

/// The tests that skipped a database's part, said once the test binary is done: a run without
/// the URLs passes those tests, and its summary would not show they did not run.
mod skipped {
    use std::collections::BTreeSet;
    use std::sync::Mutex;

    static SKIPPED: Mutex<BTreeSet<(&'static str, String)>> = Mutex::new(BTreeSet::new());

    /// The running test (libtest names each test's thread after it) skipped `variable`'s part.
    /// Code outside a test (the load test shares this module) records nothing.
    pub(super) fn record(variable: &'static str) {
        let Some(test) = std::thread::current()
            .name()
            .filter(|name| *name != "main")
            .map(str::to_owned)
        else {
            return;
        };
        SKIPPED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert((variable, test));
    }

    /// What a run that skipped database parts prints at its end.
    fn summary() -> Option<String> {
        let skipped = SKIPPED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if skipped.is_empty() {
            return None;
        }
        let tests: BTreeSet<&str> = skipped.iter().map(|(_, test)| test.as_str()).collect();
        let variables: BTreeSet<&str> = skipped.iter().map(|(variable, _)| *variable).collect();
        let names = tests.iter().copied().collect::<Vec<_>>().join(", ");
        let unset = variables.into_iter().collect::<Vec<_>>().join(" and ");
        Some(format!(
            "\nnote: {} tests passed without running their PostgreSQL or MariaDB part ({unset} not \
             set): {names}.\nRun them with a database at each URL (each test makes its own schema \
             or database), e.g. TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/test \
             TEST_MYSQL_URL=mysql://root@127.0.0.1:3306/test cargo test --all-features; `bash \
             .ci/run` starts both servers and runs everything.\n",
            tests.len()
        ))
    }

    /// At exit, after libtest's own summary. Rust's standard streams may be shut down by then,
    /// so the note is written to descriptor 2 directly.
    #[ctor::dtor]
    unsafe fn print_summary() {
        use std::io::Write;
        use std::os::fd::FromRawFd;
        if let Some(summary) = summary() {
            // SAFETY: descriptor 2 is open for the process's life; `ManuallyDrop` leaves it open.
            let mut stderr = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(2) });
            let _ = stderr.write_all(summary.as_bytes());
        }
    }
}

/// A connection to the database server at `variable`'s URL, or a panic that says what to fix
/// (the server down, the database in the URL missing, the user refused).
async fn connect_test_server(variable: &str, url: &str) -> sea_orm::DatabaseConnection {
    match Database::connect(url).await {
        Ok(connection) => connection,
        Err(error) => panic!(
            "{variable}={url}: cannot connect ({error}). The tests need a running server and an \
             existing database in the URL, in which each test makes its own schema or database: \
             create it (`createdb -U postgres test`, or `CREATE DATABASE test` in MariaDB), or \
             point the variable at one that exists (`bash .ci/run` starts both servers)."
        ),
    }
}

/// The test `PostgreSQL`'s URL; `None` (skip) in a build without `postgres`.
pub fn postgres_url() -> Option<String> {
    if cfg!(feature = "postgres") {
        database_url("TEST_POSTGRES_URL")
    } else {
        None
    }
}

fn mysql_url() -> Option<String> {
    if cfg!(feature = "mysql") {
        database_url("TEST_MYSQL_URL")
    } else {
        None
    }
}

/// A unique name for one test's schema or database.
pub fn unique_name() -> String {
    static SERIAL: AtomicU32 = AtomicU32::new(0);
    format!(
        "mg_test_{}_{}_{}",
        std::process::id(),
        SERIAL.fetch_add(1, Ordering::Relaxed),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
    )
}

/// Runs `test` on a fresh `SQLite` file, then on a `PostgreSQL` schema and a `MariaDB` database
/// of its own when those are configured, dropping each afterwards; each only when the build has
/// its backend.
pub async fn each_database(test: impl AsyncFn(&TestDb)) {
    #[cfg(feature = "sqlite")]
    test(&sqlite_db().await).await;
    if let Some(db) = postgres_db().await {
        test(&db).await;
        db.drop_schema().await;
    }
    if let Some(db) = mysql_db().await {
        test(&db).await;
        db.drop_schema().await;
    }
}

/// A fresh database on the test MySQL/MariaDB server.
pub async fn mysql_db() -> Option<TestDb> {
    let (server, database, url) = empty_mysql_database().await?;
    let store = Arc::new(SeaOrmStore::connect(&url).await.unwrap());
    Some(TestDb {
        store,
        url,
        _dir: None,
        pg_schema: None,
        mysql_database: Some((server, database)),
    })
}

/// A new, empty database on the test MySQL/MariaDB server: the server's URL, the database's
/// name and its URL. The caller drops it.
pub async fn empty_mysql_database() -> Option<(String, String, String)> {
    let server = mysql_url()?;
    let database = unique_name();
    let admin = connect_test_server("TEST_MYSQL_URL", &server).await;
    admin
        .execute_unprepared(&format!("CREATE DATABASE {database}"))
        .await
        .unwrap();
    admin.close().await.unwrap();
    // mysql://user@host:port/db?params -> the same with this test's database.
    let (base, params) = server.split_once('?').unwrap_or((&server, ""));
    let root = &base[..base
        .rfind('/')
        .filter(|&i| i > "mysql://".len())
        .unwrap_or(base.len())];
    let url = if params.is_empty() {
        format!("{root}/{database}")
    } else {
        format!("{root}/{database}?{params}")
    };
    Some((server, database, url))
}

/// A fresh schema on the test `PostgreSQL`, so parallel tests and runs never collide.
pub async fn postgres_db() -> Option<TestDb> {
    let url = postgres_url()?;
    let schema = unique_name();
    let admin = connect_test_server("TEST_POSTGRES_URL", &url).await;
    admin
        .execute_unprepared(&format!("CREATE SCHEMA {schema}"))
        .await
        .unwrap();
    admin.close().await.unwrap();
    Some(TestDb {
        store: Arc::new(postgres_store(&url, &schema).await),
        url,
        _dir: None,
        pg_schema: Some(schema),
        mysql_database: None,
    })
}

/// Another connection pool on the same schema: what a second gateway process would have.
pub async fn postgres_store(url: &str, schema: &str) -> SeaOrmStore {
    let mut options = ConnectOptions::new(url);
    options
        .set_schema_search_path(schema)
        .set_application_name(schema)
        .max_connections(10);
    SeaOrmStore::connect_with(options).await.unwrap()
}

impl TestDb {
    /// A handle on the same database through another store (another process's pool).
    /// Dropping it drops nothing.
    pub fn sharing(other: &TestDb, store: Arc<SeaOrmStore>) -> TestDb {
        TestDb {
            store,
            url: other.url.clone(),
            _dir: None,
            pg_schema: None,
            mysql_database: None,
        }
    }

    /// A database the test made itself (a file it keeps in a place of its own).
    pub fn at(store: Arc<SeaOrmStore>, url: String) -> TestDb {
        TestDb {
            store,
            url,
            _dir: None,
            pg_schema: None,
            mysql_database: None,
        }
    }

    /// The same database through a second store with its own pool, as a second gateway
    /// process would have it.
    pub async fn second_instance(&self) -> TestDb {
        let store = match &self.pg_schema {
            Some(schema) => postgres_store(&self.url, schema).await,
            None => SeaOrmStore::connect(&self.url).await.unwrap(),
        };
        TestDb::sharing(self, Arc::new(store))
    }

    pub fn pg_schema(&self) -> Option<&str> {
        self.pg_schema.as_deref()
    }

    /// Drops the `PostgreSQL` schema or `MySQL` database (`SQLite` files go with their directory).
    pub async fn drop_schema(mut self) {
        if self.mysql_database.is_some() {
            self.store.connection().clone().close().await.unwrap();
        }
        let (schema, mysql) = (self.pg_schema.take(), self.mysql_database.take());
        drop_database(&self.url, schema, mysql).await.unwrap();
    }

    /// An account with one key and these credits; returns the clear key.
    pub async fn funded_key(&self, subscription: i64, topup: i64) -> String {
        let new = model_gateway::admin::NewAccount {
            name: "test".into(),
            subscription,
            topup,
        };
        self.admin().create_account(&new).await.unwrap().key
    }

    /// The operator's operations on this database.
    pub fn admin(&self) -> model_gateway::admin::Admin<SeaOrmStore> {
        model_gateway::admin::Admin::new(self.store.clone())
    }

    pub async fn balance(&self, key: &str) -> Balance {
        let caller = self.caller(key).await;
        self.store.balance(caller.account).await.unwrap()
    }

    pub async fn calls(&self, key: &str) -> Vec<CallRecord> {
        let caller = self.caller(key).await;
        self.store
            .recent_calls(caller.account, 10_000)
            .await
            .unwrap()
    }

    pub async fn account(&self, key: &str) -> model_gateway::AccountId {
        self.caller(key).await.account
    }

    /// Whose key `key` is.
    pub async fn caller(&self, key: &str) -> model_gateway::store::Caller {
        self.store
            .caller_for_key(&KeyHash::of(key))
            .await
            .unwrap()
            .expect("key exists")
    }

    /// `grants - charges of ok and pending calls = balance`, for every account.
    pub async fn assert_audit_holds(&self) {
        let audits = self.store.audit().await.unwrap();
        assert!(!audits.is_empty());
        for audit in audits {
            assert!(audit.holds(), "audit failed: {audit:?}");
        }
    }
}

/// A schema or database that no test dropped (one on [`local_db`]) is dropped with its
/// `TestDb`, on a thread with a runtime of its own (this runs inside the test's runtime).
impl Drop for TestDb {
    fn drop(&mut self) {
        let (schema, mysql) = (self.pg_schema.take(), self.mysql_database.take());
        if schema.is_none() && mysql.is_none() {
            return;
        }
        let url = self.url.clone();
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|error| error.to_string())?;
            runtime
                .block_on(drop_database(&url, schema, mysql))
                .map_err(|error| error.to_string())
        })
        .join();
        if let Ok(Err(error)) = dropped {
            eprintln!("dropping a test database failed: {error}");
        }
    }
}

/// Drops a test's `PostgreSQL` schema (on the server at `url`) or its `MySQL` database.
async fn drop_database(
    url: &str,
    schema: Option<String>,
    mysql: Option<(String, String)>,
) -> Result<(), sea_orm::DbErr> {
    if let Some(schema) = schema {
        let admin = Database::connect(url).await?;
        // A test that failed may have left a transaction open on its own runtime, which
        // waits for this drop: give up after a while rather than hang.
        admin
            .execute_unprepared(&format!(
                "SET lock_timeout = '10s'; DROP SCHEMA {schema} CASCADE"
            ))
            .await?;
        admin.close().await?;
    }
    if let Some((server, database)) = mysql {
        let admin = Database::connect(&server).await?;
        admin
            .execute_unprepared(&format!("DROP DATABASE {database}"))
            .await?;
        admin.close().await?;
    }
    Ok(())
}

pub fn balance(subscription: i64, topup: i64) -> Balance {
    Balance {
        subscription: Credits::new(subscription),
        topup: Credits::new(topup),
    }
}

/// A running gateway.
pub struct Gateway {
    pub base: String,
    pub client: reqwest::Client,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.server.abort();
    }
}

pub async fn start_gateway(
    db: &TestDb,
    catalogue: Catalogue,
    upstream: Upstream,
    max_body_bytes: usize,
) -> Gateway {
    serve_router(gateway_router(db, catalogue, upstream, max_body_bytes)).await
}

/// The example gateway's router on `db`.
pub fn gateway_router(
    db: &TestDb,
    catalogue: Catalogue,
    upstream: Upstream,
    max_body_bytes: usize,
) -> axum::Router {
    model_gateway::Gateway::new(db.store.clone(), Arc::new(catalogue), upstream)
        .body_limits(max_body_bytes)
        .router()
}

/// `router` served over real HTTP on an ephemeral port, as the example gateway serves it.
pub async fn serve_router(router: axum::Router) -> Gateway {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    serve_router_on(listener, router)
}

/// `router` served on `listener`, as the example gateway serves it.
pub fn serve_router_on(listener: tokio::net::TcpListener, router: axum::Router) -> Gateway {
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move {
        let limits = model_gateway::server::ServerLimits::default();
        model_gateway::server::serve(listener, router, limits, std::future::pending())
            .await
            .unwrap();
    });
    Gateway {
        base,
        client: reqwest::Client::new(),
        server,
    }
}

/// The example gateway calling the providers `catalogue` names over HTTP, with every provider
/// key `sk-provider`.
pub async fn http_gateway(db: &TestDb, catalogue: Catalogue) -> Gateway {
    let upstream = model_gateway::upstream::HttpUpstream::with_keys(&catalogue, |_| {
        Some("sk-provider".into())
    })
    .unwrap();
    start_gateway(
        db,
        catalogue,
        Upstream::Http(upstream),
        DEFAULT_MAX_BODY_BYTES,
    )
    .await
}

/// What every call gets, a call to `path` (a model of `price` called by `body`) gets too: its
/// request id answered and logged, an idempotency key's retry replayed byte for byte and
/// uncharged, and a key's model rule refusing it (403) uncharged.
pub async fn assert_the_rules_of_every_call(path: &str, body: &Value, price: i64) {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let keyed = |idem: &'static str| {
        gateway
            .client
            .post(format!("{}{path}", gateway.base))
            .bearer_auth(&key)
            .header("content-type", "application/json")
            .header("x-request-id", format!("rules-{idem}"))
            .header("idempotency-key", idem)
            .body(body.to_string())
    };
    let first = gateway.send(keyed("once")).await;
    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(first.headers["x-request-id"], "rules-once");
    assert!(
        first
            .headers
            .get(model_gateway::charge::IDEMPOTENT_REPLAYED_HEADER)
            .is_none()
    );
    let again = gateway.send(keyed("once")).await;
    assert_eq!(again.status, 200);
    assert_eq!(
        again.headers[model_gateway::charge::IDEMPOTENT_REPLAYED_HEADER],
        "true"
    );
    assert_eq!(again.bytes, first.bytes, "the same reply, ids and all");
    assert_eq!(db.balance(&key).await, balance(10 - price, 0));
    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].request_id.as_deref(), Some("rules-once"));

    // A key that may call only the messages model is refused this one, uncharged.
    let id = db.caller(&key).await.key;
    let only_messages = model_gateway::admin::KeyPatch {
        models: Some(Some(vec![MESSAGES_MODEL.into()])),
        ..model_gateway::admin::KeyPatch::default()
    };
    model_gateway::admin::Admin::new(db.store.clone())
        .update_key(id, &only_messages)
        .await
        .unwrap();
    let refused = gateway.post_bearer(path, &key, body.to_string()).await;
    assert_eq!(
        (refused.status, refused.detail()),
        (403, "该 API Key 无权使用此模型")
    );
    assert_eq!(db.balance(&key).await, balance(10 - price, 0));
    assert_eq!(db.calls(&key).await.len(), 1);
    db.assert_audit_holds().await;
}

/// The example gateway in mock mode with the demo catalogue.
pub async fn start_mock_gateway(db: &TestDb) -> Gateway {
    start_mock_gateway_with(db, Catalogue::demo()).await
}

/// The gateway in mock mode serving `catalogue`.
pub async fn start_mock_gateway_with(db: &TestDb, catalogue: Catalogue) -> Gateway {
    start_gateway(
        db,
        catalogue,
        Upstream::Mock(MockUpstream::new()),
        DEFAULT_MAX_BODY_BYTES,
    )
    .await
}

/// An answer: status and parsed JSON body (`Value::Null` if the body is not JSON).
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
    pub bytes: bytes::Bytes,
}

impl Answer {
    pub fn detail(&self) -> &str {
        self.body["detail"].as_str().unwrap_or_else(|| {
            panic!(
                "no detail in {} {:?}",
                self.status,
                String::from_utf8_lossy(&self.bytes)
            )
        })
    }
}

impl Gateway {
    pub async fn send(&self, request: reqwest::RequestBuilder) -> Answer {
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let bytes = response.bytes().await.unwrap();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Answer {
            status,
            headers,
            body,
            bytes,
        }
    }

    /// POST `body` to `path` with `Authorization: Bearer key`.
    pub async fn post_bearer(
        &self,
        path: &str,
        key: &str,
        body: impl Into<reqwest::Body>,
    ) -> Answer {
        self.post_with(path, "authorization", &format!("Bearer {key}"), body)
            .await
    }

    /// POST `body` to `path` with `x-api-key: key`.
    pub async fn post_x_api_key(
        &self,
        path: &str,
        key: &str,
        body: impl Into<reqwest::Body>,
    ) -> Answer {
        self.post_with(path, "x-api-key", key, body).await
    }

    async fn post_with(
        &self,
        path: &str,
        auth_header: &str,
        auth_value: &str,
        body: impl Into<reqwest::Body>,
    ) -> Answer {
        self.send(
            self.client
                .post(format!("{}{path}", self.base))
                .header(auth_header, auth_value)
                .header("content-type", "application/json")
                .body(body),
        )
        .await
    }

    pub async fn chat(&self, key: &str, model: &str) -> Answer {
        self.post_bearer(CHAT, key, chat_body(model)).await
    }

    pub async fn messages(&self, key: &str, model: &str) -> Answer {
        self.post_x_api_key(MESSAGES, key, messages_body(model))
            .await
    }
}

/// One chat call with the demo chat model, for spawned tasks (which cannot borrow a
/// [`Gateway`]): the answer's status.
pub async fn chat_status(client: &reqwest::Client, url: &str, key: &str) -> u16 {
    client
        .post(url)
        .bearer_auth(key)
        .body(chat_body(CHAT_MODEL))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

pub const CHAT: &str = "/v1/chat/completions";
pub const MESSAGES: &str = "/v1/messages";
/// Demo catalogue prices.
pub const CHAT_MODEL: &str = "gpt-4o-mini";
pub const CHAT_PRICE: i64 = 2;
pub const MESSAGES_MODEL: &str = "claude-haiku-4-5";
pub const MESSAGES_PRICE: i64 = 3;

pub fn chat_body(model: &str) -> String {
    serde_json::json!({ "model": model, "messages": [{ "role": "user", "content": "Hello" }] })
        .to_string()
}

pub fn messages_body(model: &str) -> String {
    serde_json::json!({
        "model": model,
        "max_tokens": 64,
        "messages": [{ "role": "user", "content": "Hello" }]
    })
    .to_string()
}

/// Grants on an existing account, for tests that need an exact split.
pub async fn grant(db: &TestDb, key: &str, bucket: Bucket, amount: i64) {
    let caller = db.caller(key).await;
    db.store
        .grant(caller.account, bucket, Credits::new(amount))
        .await
        .unwrap();
}

/// A catalogue TOML with one OpenAI-style upstream `name` at `base` (key variable `key_env`)
/// serving the chat test model; `extra` goes into the upstream's table.
pub fn one_upstream_toml(name: &str, base: &str, key_env: &str, extra: &str) -> String {
    format!(
        "[[upstreams]]\nname = \"{name}\"\nkind = \"openai\"\nbase_url = \"{base}/v1\"\napi_key_env = \"{key_env}\"\n{extra}\n\
         [[models]]\nname = \"{CHAT_MODEL}\"\nprotocol = \"chat_completions\"\nprice = {CHAT_PRICE}\nupstream = \"{name}\"\n"
    )
}

/// A key that exists nowhere.
pub fn stranger_key() -> String {
    NewApiKey::generate().reveal().to_owned()
}

/// Revokes a key through the store.
pub async fn revoke(db: &TestDb, key: &str) {
    assert!(db.store.revoke_key(&KeyHash::of(key)).await.unwrap());
}

/// An address on loopback that was free a moment ago.
pub fn free_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

/// Waits until something accepts connections at `address` (a process just started); panics
/// after 30 s.
pub async fn listening(address: &str) {
    wait_for("something to listen", async || {
        std::net::TcpStream::connect(address).is_ok()
    })
    .await;
}

/// Waits until `done`, checking every 100 ms; panics after 30 s, naming `what`.
pub async fn wait_for(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let started = std::time::Instant::now();
    while !done().await {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// The example gateway binary that `cargo test` builds next to the tests.
pub fn gateway_binary() -> std::path::PathBuf {
    // target/debug/deps/TEST-HASH -> target/debug/examples/gateway
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("gateway");
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --example gateway`",
        path.display()
    );
    path
}

/// Resident memory of process `pid`, in KiB, from `/proc`.
pub fn resident_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|line| line.starts_with("VmRSS:"))
        .and_then(|line| line.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// One test per database backend, each on a database of its own (dropped with it; a backend
/// whose test URL is unset is skipped, one the build lacks is not compiled):
///
/// ```ignore
/// backends!(
///     /// What the test shows.
///     async fn refunds_pay_back_once(db) { assert_refunds_pay_back_once(&db).await; }
/// );
/// ```
///
/// defines `refunds_pay_back_once::sqlite`, `::postgres` and `::mysql`. `#[multi_thread]`
/// before `async` runs each on four worker threads.
#[allow(unused_macros)]
macro_rules! backends {
    ($(#[doc = $doc:literal])* #[multi_thread] async fn $name:ident($db:ident) $body:block) => {
        backends!(@define [tokio::test(flavor = "multi_thread", worker_threads = 4)]
            $(#[doc = $doc])* $name $db $body);
    };
    ($(#[doc = $doc:literal])* async fn $name:ident($db:ident) $body:block) => {
        backends!(@define [tokio::test] $(#[doc = $doc])* $name $db $body);
    };
    (@define [$test:meta] $(#[doc = $doc:literal])* $name:ident $db:ident $body:block) => {
        $(#[doc = $doc])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            #[cfg(feature = "sqlite")]
            #[$test]
            async fn sqlite() {
                let $db = $crate::common::sqlite_db().await;
                $body
            }

            #[cfg(feature = "postgres")]
            #[$test]
            async fn postgres() {
                let Some($db) = $crate::common::postgres_db().await else {
                    return;
                };
                $body
            }

            #[cfg(feature = "mysql")]
            #[$test]
            async fn mysql() {
                let Some($db) = $crate::common::mysql_db().await else {
                    return;
                };
                $body
            }
        }
    };
}

/// Reserves a chat call of `price` credits for `caller`.
pub async fn reserve_price<S: model_gateway::Store>(
    store: &S,
    caller: model_gateway::store::Caller,
    price: i64,
) -> Result<model_gateway::store::Reservation, model_gateway::store::ReserveError> {
    store
        .reserve(model_gateway::store::ChargeRequest::new(
            caller,
            model_gateway::Protocol::ChatCompletions,
            CHAT_MODEL,
            Credits::new(price),
        ))
        .await
}

/// A call the mock upstream answered, charged its price.
pub fn mock_success() -> model_gateway::store::CallSuccess {
    model_gateway::store::CallSuccess {
        upstream_status: 200,
        usage: Default::default(),
        channel: Some("mock".into()),
        cost: None,
        reply: None,
        ..Default::default()
    }
}

/// An upstream that answered 500: the call is refunded.
pub fn upstream_failure() -> model_gateway::store::CallFailure {
    model_gateway::store::CallFailure {
        upstream_status: Some(500),
        error: "upstream failed".into(),
    }
}
