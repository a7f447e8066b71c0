//! A settle that the database takes late (a row lock held by another connection, a silent
//! server): a client told `503` ("nothing charged, retry") is never billed, and a retry is
//! billed once (the adversarial run: a settle held 8 s by `SELECT ... FOR UPDATE` committed
//! after its `503`, PostgreSQL 3 of 3, MariaDB 2 of 2). On `PostgreSQL` and `MariaDB`, whose
//! rows another connection can lock, through the layers over the sea-orm store.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use http::Request;
use http_body_util::Full;
use model_gateway::store::{CallStatus, Reservation};
use model_gateway::{
    ApiKeyAuthLayer, Catalogue, CreditChargeLayer, ProtocolRouterLayer, RefundOnUpstreamErrorLayer,
    SeaOrmStore, upstream::MockUpstream,
};
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

/// The call's entry is locked by another connection while its upstream answers, for longer
/// than the call waits for its settle: the client gets `503`; once the lock goes, the call ends
/// `refunded` with every credit back, and the retry is billed once.
async fn a_settle_locked_past_its_time_out_is_never_billed(db: &TestDb) {
    let key = db.funded_key(10, 0).await;
    let (called, mut calls) = tokio::sync::mpsc::unbounded_channel();
    let answer = Arc::new(tokio::sync::Notify::new());
    let service = stack(&db.store, called, answer.clone());

    let request = tokio::spawn(service.clone().oneshot(chat_request(&key)));
    let call = calls.recv().await.unwrap();
    // Another connection of the pool: what another process's transaction would be.
    let lock = db.store.connection().begin().await.unwrap();
    lock.execute_unprepared(&format!(
        "SELECT id FROM mg_calls WHERE id = {call} FOR UPDATE"
    ))
    .await
    .unwrap();
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
    lock.rollback().await.unwrap();

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
