//! A settle that the database takes late (a lock held by another connection, a silent server):
//! a client told `503` ("nothing charged, retry") is never billed, and a retry is billed once
//! (the adversarial run: a settle held 8 s by `SELECT ... FOR UPDATE` committed after its
//! `503`, PostgreSQL 3 of 3, MariaDB 2 of 2). On `PostgreSQL` and `MariaDB` the entry's row is
//! locked; on a `SQLite` file, shared or owned by its store, another connection holds the
//! file's write lock. Through the layers over the sea-orm store.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use http::Request;
use http_body_util::Full;
#[cfg(feature = "postgres")]
use model_gateway::store::Leases;
use model_gateway::store::{CallStatus, Reservation};
use model_gateway::{
    ApiKeyAuthLayer, Catalogue, CreditChargeLayer, ProtocolRouterLayer, RefundOnUpstreamErrorLayer,
    SeaOrmStore, upstream::MockUpstream,
};
#[cfg(any(feature = "postgres", feature = "mysql"))]
use sea_orm::{ConnectionTrait, TransactionTrait};
use tower::{ServiceBuilder, ServiceExt, service_fn};

/// How long a call waits for its settle before it answers `503`.
const LEDGER_TIMEOUT: Duration = Duration::from_millis(800);

fn chat_request(key: &str) -> Request<Full<Bytes>> {
    Request::post(CHAT)
        .header("authorization", format!("Bearer {key}"))
        .body(Full::new(Bytes::from(chat_body(CHAT_MODEL))))
        .unwrap()
}

/// The layers over the mock upstream, which tells `called` which call it serves and answers
/// once `answer` is notified.
fn stack(
    store: &Arc<SeaOrmStore>,
    called: tokio::sync::mpsc::UnboundedSender<i64>,
    answer: Arc<tokio::sync::Notify>,
) -> tower::util::BoxCloneService<
    Request<Full<Bytes>>,
    http::Response<model_gateway::refund::ResponseBody>,
    std::convert::Infallible,
> {
    let upstream = service_fn(move |request: Request<Bytes>| {
        let (called, answer) = (called.clone(), answer.clone());
        async move {
            let call = request.extensions().get::<Reservation>().unwrap().call;
            called.send(call.0).unwrap();
            answer.notified().await;
            MockUpstream::new().oneshot(request).await
        }
    });
    tower::util::BoxCloneService::new(
        ServiceBuilder::new()
            .layer(model_gateway::request_id::RequestIdLayer::new())
            .layer(ApiKeyAuthLayer::new(store.clone()))
            .layer(ProtocolRouterLayer::new(Arc::new(Catalogue::demo())))
            .layer(CreditChargeLayer::new(store.clone()).ledger_timeout(LEDGER_TIMEOUT))
            .layer(RefundOnUpstreamErrorLayer::new(store.clone()).ledger_timeout(LEDGER_TIMEOUT))
            .service(upstream),
    )
}

/// The call's entry once it is no longer `pending`.
async fn ended(db: &TestDb, key: &str) -> model_gateway::store::CallRecord {
    let started = Instant::now();
    loop {
        let calls = db.calls(key).await;
        if let Some(call) = calls
            .first()
            .filter(|call| call.status != CallStatus::Pending)
        {
            return call.clone();
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "still pending: {calls:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Another connection's lock that a call's settle must wait for.
enum Lock {
    /// A transaction holding the call's entry `FOR UPDATE`, as another process's would.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    Row(sea_orm::DatabaseTransaction),
    /// A connection of its own holding the file's write lock (`BEGIN IMMEDIATE`), as another
    /// process writing to the file would (the CLI, an admin tool).
    #[cfg(feature = "sqlite")]
    File(rusqlite::Connection),
}

impl Lock {
    /// Takes the lock that holds back the settle of `call`.
    #[allow(unused_variables)] // `call`, in a build with `SQLite` alone
    async fn taken(db: &TestDb, call: i64) -> Lock {
        #[cfg(feature = "sqlite")]
        if let Some(file) = db.store.sqlite_file() {
            let connection = rusqlite::Connection::open(file).unwrap();
            connection.execute_batch("BEGIN IMMEDIATE").unwrap();
            return Lock::File(connection);
        }
        #[cfg(any(feature = "postgres", feature = "mysql"))]
        {
            // Another connection of the pool: what another process's transaction would be.
            let lock = db.store.connection().begin().await.unwrap();
            lock.execute_unprepared(&format!(
                "SELECT id FROM mg_calls WHERE id = {call} FOR UPDATE"
            ))
            .await
            .unwrap();
            Lock::Row(lock)
        }
        #[cfg(not(any(feature = "postgres", feature = "mysql")))]
        unreachable!("a build with SQLite alone tests on SQLite")
    }

    async fn release(self) {
        match self {
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            Lock::Row(lock) => lock.rollback().await.unwrap(),
            #[cfg(feature = "sqlite")]
            Lock::File(connection) => connection.execute_batch("ROLLBACK").unwrap(),
        }
    }
}

/// The call's entry (or its file) is locked by another connection while its upstream answers, for longer
/// than the call waits for its settle: the client gets `503`; once the lock goes, the call ends
/// `refunded` with every credit back, and the retry is billed once.
async fn a_settle_locked_past_its_time_out_is_never_billed(db: &TestDb) {
    let key = db.funded_key(10, 0).await;
    let (called, mut calls) = tokio::sync::mpsc::unbounded_channel();
    let answer = Arc::new(tokio::sync::Notify::new());
    let service = stack(&db.store, called, answer.clone());

    let request = tokio::spawn(service.clone().oneshot(chat_request(&key)));
    let call = calls.recv().await.unwrap();
    let lock = Lock::taken(db, call).await;
    answer.notify_one();
    let started = Instant::now();
    let response = request.await.unwrap().unwrap();
    assert_eq!(
        response.status(),
        503,
        "the settle was waited for past its lock"
    );
    assert!(started.elapsed() < LEDGER_TIMEOUT * 4);
    // The lock outlasts the answer, then goes: the settle would land now.
    tokio::time::sleep(LEDGER_TIMEOUT).await;
    lock.release().await;

    let entry = ended(db, &key).await;
    assert_eq!(entry.status, CallStatus::Refunded, "{entry:?}");
    assert_eq!(db.balance(&key).await.total().get(), 10);

    // The retry the 503 invited: billed once.
    let retry = tokio::spawn(service.oneshot(chat_request(&key)));
    calls.recv().await.unwrap();
    answer.notify_one();
    assert_eq!(retry.await.unwrap().unwrap().status(), 200);
    let entries = db.calls(&key).await;
    let billed = entries
        .iter()
        .filter(|call| call.status == CallStatus::Ok)
        .count();
    assert_eq!((entries.len(), billed), (2, 1), "{entries:?}");
    assert_eq!(db.balance(&key).await.total().get(), 10 - CHAT_PRICE);
    db.assert_audit_holds().await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_postgres_a_settle_locked_past_its_time_out_is_never_billed() {
    let Some(db) = postgres_db().await else {
        return;
    };
    a_settle_locked_past_its_time_out_is_never_billed(&db).await;
    db.drop_schema().await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_mariadb_a_settle_locked_past_its_time_out_is_never_billed() {
    let Some(db) = mysql_db().await else {
        return;
    };
    a_settle_locked_past_its_time_out_is_never_billed(&db).await;
    db.drop_schema().await;
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_shared_sqlite_file_a_settle_locked_past_its_time_out_is_never_billed() {
    a_settle_locked_past_its_time_out_is_never_billed(&sqlite_db().await).await;
}

/// On a file its store owns, the call is held in memory and written once, by a batch that waits
/// for the file's write lock: the settle is left out of it, and the call's refund ends it.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_an_owned_sqlite_file_a_settle_locked_past_its_time_out_is_never_billed() {
    let db = owned_sqlite_db().await;
    a_settle_locked_past_its_time_out_is_never_billed(&db).await;
    assert_eq!(db.store.held_reservations().await, 0);
}

/// In `PostgreSQL` escrow, an ending is written by one statement that commits itself: the
/// writer claims the settle just before it sends that statement. A settle whose escrow row
/// another connection holds locked past the call's time-out was claimed already: the call is
/// billed, so its reply is handed out (never a `503` for something billed), and the entry
/// lands once the lock goes.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_escrow_a_settle_claimed_before_its_lock_is_billed_and_its_reply_handed_out() {
    let Some(db) = postgres_db().await else {
        return;
    };
    let escrow = postgres_store(&db.url, db.pg_schema().unwrap())
        .await
        .with_escrow()
        .unwrap();
    escrow
        .take_lease(chrono::Utc::now(), Duration::from_secs(600))
        .await
        .unwrap()
        .unwrap();
    let escrow = Arc::new(escrow);
    let key = db.funded_key(0, 1000).await;
    let (called, mut calls) = tokio::sync::mpsc::unbounded_channel();
    let answer = Arc::new(tokio::sync::Notify::new());
    let service = stack(&escrow, called, answer.clone());

    let request = tokio::spawn(service.oneshot(chat_request(&key)));
    calls.recv().await.unwrap();
    assert_eq!(escrow.held_reservations().await, 1, "held against escrow");
    let lock = db.store.connection().begin().await.unwrap();
    lock.execute_unprepared("SELECT * FROM mg_escrows FOR UPDATE")
        .await
        .unwrap();
    answer.notify_one();
    let response = request.await.unwrap().unwrap();
    assert_eq!(response.status(), 200, "billed, so handed out");
    tokio::time::sleep(LEDGER_TIMEOUT).await;
    assert!(db.calls(&key).await.is_empty(), "written under the lock");
    lock.rollback().await.unwrap();

    let entry = ended(&db, &key).await;
    assert_eq!(entry.status, CallStatus::Ok, "{entry:?}");
    assert_eq!(db.calls(&key).await.len(), 1);
    escrow.release_lease().await.unwrap();
    assert_eq!(db.balance(&key).await.total().get(), 1000 - CHAT_PRICE);
    db.assert_audit_holds().await;
    db.drop_schema().await;
}
