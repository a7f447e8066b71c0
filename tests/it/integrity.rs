//! Money integrity when calls stop half-way: dropped request futures, client disconnects,
//! panicking or silent upstreams, crashed gateways (recovery), and the audit that checks it all.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use common::fake_provider::{FakeProvider, Fault};
use common::*;
use http::{Request, Response};
use http_body_util::Full;
use model_gateway::{
    AccountId, Accounts, ApiKeyAuthLayer, Balance, CallId, CallLog, Catalogue, CreditChargeLayer,
    Credits, KeyStore, Ledger, MemoryStore, ProtocolRouterLayer, RefundOnUpstreamErrorLayer,
    Upstream, charge::CANCELLED_WHILE_RESERVING, credits::Bucket, error::UpstreamError,
    keys::NewApiKey, recovery::recover_stale_reservations, refund::CANCELLED_BEFORE_ANSWER,
    store::CallFailure, store::CallRecord, store::CallStatus, store::CallSuccess,
    store::ChargeRequest, store::Reservation, store::ReserveError, store::StoreError,
    upstream::HttpUpstream, upstream::UpstreamBody,
};
use sea_orm::ConnectionTrait;
use tower::{ServiceBuilder, ServiceExt, service_fn};

type Upstreamish = tower::util::BoxCloneSyncService<Request<Bytes>, Response<Bytes>, UpstreamError>;

fn never_answers() -> Upstreamish {
    tower::util::BoxCloneSyncService::new(service_fn(|_: Request<Bytes>| async {
        std::future::pending::<Result<Response<Bytes>, UpstreamError>>().await
    }))
}

fn chat_request(key: &str) -> Request<Full<Bytes>> {
    Request::post(CHAT)
        .header("authorization", format!("Bearer {key}"))
        .body(Full::new(Bytes::from(chat_body(CHAT_MODEL))))
        .unwrap()
}

/// An in-memory store with one account of `credits` subscription credits and its key.
async fn funded_memory(credits: i64) -> (Arc<MemoryStore>, AccountId, String) {
    let store = Arc::new(MemoryStore::new());
    let (account, key) = funded(&store, credits).await;
    (store, account, key)
}

/// The same, with a [`TestLedger`] over the store.
async fn ledger_on_memory(credits: i64) -> (Arc<MemoryStore>, Arc<TestLedger>, AccountId, String) {
    let (store, account, key) = funded_memory(credits).await;
    let ledger = TestLedger::new(store.clone());
    (store, ledger, account, key)
}

async fn funded(store: &MemoryStore, credits: i64) -> (AccountId, String) {
    let account = store.create_account("t").await.unwrap();
    let key = NewApiKey::generate();
    store.add_key(account, &key).await.unwrap();
    store
        .grant(account, Bucket::Subscription, Credits::new(credits))
        .await
        .unwrap();
    (account, key.reveal().to_owned())
}

/// Waits (up to 5 s) for the account's newest call to leave `pending`.
async fn finished_call(store: &dyn CallLog, account: AccountId) -> CallRecord {
    for _ in 0..100 {
        let calls = store.recent_calls(account, 1).await.unwrap();
        if let Some(call) = calls
            .into_iter()
            .next()
            .filter(|c| c.status != CallStatus::Pending)
        {
            return call;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the call stayed pending");
}

#[tokio::test]
async fn a_call_dropped_before_the_upstream_answered_is_refunded() {
    let (store, account, key) = funded_memory(10).await;
    let service = model_gateway::stack(
        store.clone(),
        Arc::new(Catalogue::demo()),
        1 << 20,
        never_answers(),
    );

    let call = service.oneshot(chat_request(&key));
    assert!(
        tokio::time::timeout(Duration::from_millis(200), call)
            .await
            .is_err()
    );

    let call = finished_call(store.as_ref(), account).await;
    assert_eq!(call.status, CallStatus::Refunded);
    assert_eq!(
        call.upstream_error.as_deref(),
        Some(CANCELLED_BEFORE_ANSWER)
    );
    assert_total(&*store, account, 10).await;
}

/// Holds `account`'s row (on `SQLite`, the whole file's write lock) on another connection, as a
/// busy second gateway or the CLI would, so that a reservation's write waits for it.
async fn hold_writes(db: &TestDb, account: AccountId) -> sea_orm::DatabaseTransaction {
    use sea_orm::{SqliteTransactionMode, TransactionOptions, TransactionTrait};
    let other = db.second_instance().await.store.connection().clone();
    let backend = other.get_database_backend();
    if backend == sea_orm::DbBackend::Sqlite {
        return other
            .begin_with_options(TransactionOptions {
                sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
                ..TransactionOptions::default()
            })
            .await
            .unwrap();
    }
    let txn = other.begin().await.unwrap();
    let locked = txn
        .query_all_raw(sea_orm::Statement::from_string(
            backend,
            format!(
                "SELECT id FROM mg_accounts WHERE id = {} FOR UPDATE",
                account.0
            ),
        ))
        .await
        .unwrap();
    assert_eq!(locked.len(), 1);
    txn
}

/// A request dropped while its reservation's write waits (for another writer's lock) is not
/// abandoned: the reservation lands after its client is gone, is refunded at once, and the
/// upstream is never called. Left alone, its credits would stay taken and its entry `pending`
/// until recovery; with an `Idempotency-Key`, every retry would meanwhile be refused as still
/// running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_dropped_while_its_reservation_is_written_is_refunded() {
    each_database(async |db| {
        for keyed in [false, true] {
            let key = db.funded_key(10, 0).await;
            let account = db.account(&key).await;
            let service = model_gateway::stack(
                db.store.clone(),
                Arc::new(Catalogue::demo()),
                1 << 20,
                model_gateway::upstream::MockUpstream::new(),
            );
            let request = || {
                let mut request = chat_request(&key);
                if keyed {
                    let idempotency = http::HeaderValue::from_static("retry-me");
                    request.headers_mut().insert("idempotency-key", idempotency);
                }
                request
            };

            let held = hold_writes(db, account).await;
            let dropped = service.clone().oneshot(request());
            let gave_up = tokio::time::timeout(Duration::from_millis(300), dropped).await;
            assert!(gave_up.is_err(), "the reservation waited for the lock");
            held.commit().await.unwrap();

            let call = finished_call(db.store.as_ref(), account).await;
            assert_eq!(call.status, CallStatus::Refunded, "keyed: {keyed}");
            assert_eq!(
                call.upstream_error.as_deref(),
                Some(CANCELLED_WHILE_RESERVING)
            );
            assert_eq!(db.balance(&key).await, balance(10, 0));

            // The client tries again: a new call, billed once.
            let again = service.oneshot(request()).await.unwrap();
            assert_eq!(again.status(), http::StatusCode::OK, "keyed: {keyed}");
            assert_eq!(db.balance(&key).await, balance(10 - CHAT_PRICE, 0));
            let statuses: Vec<_> = db.calls(&key).await.iter().map(|c| c.status).collect();
            assert_eq!(statuses.len(), 2, "{statuses:?}");
            assert!(statuses.contains(&CallStatus::Ok) && statuses.contains(&CallStatus::Refunded));
        }
        db.assert_audit_holds().await;
    })
    .await;
}

/// Sends a chat call over HTTP and hangs up if no answer came within `patience`.
async fn hang_up_after(gateway: &Gateway, key: &str, patience: Duration) {
    let hung_up = gateway
        .client
        .post(format!("{}{CHAT}", gateway.base))
        .bearer_auth(key)
        .timeout(patience)
        .body(chat_body(CHAT_MODEL))
        .send()
        .await;
    assert!(hung_up.is_err(), "the client gave up");
}

/// The store on its own, without `CreditCharge`: a reservation whose caller stopped waiting
/// while its batch waited for another writer lands, and the store refunds it in its next batch
/// (on `PostgreSQL` after the flush that answers it), instead of leaving it `pending` with its
/// credits taken until the gateway's lease ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_whose_caller_stopped_waiting_is_refunded_by_the_store() {
    each_database(async |db| {
        let key = db.funded_key(10, 0).await;
        let account = db.account(&key).await;
        let caller = db.caller(&key).await;

        let held = hold_writes(db, account).await;
        let store = db.store.clone();
        let reserving = tokio::spawn(async move { store.reserve(chat_charge(caller)).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        reserving.abort();
        assert!(reserving.await.unwrap_err().is_cancelled());
        held.commit().await.unwrap();

        let call = finished_call(db.store.as_ref(), account).await;
        assert_eq!(call.status, CallStatus::Refunded);
        assert!(
            (call.upstream_error.as_deref()).is_some_and(|why| why.contains("stopped waiting")),
            "{:?}",
            call.upstream_error
        );
        assert_eq!(db.balance(&key).await, balance(10, 0));
        db.assert_audit_holds().await;
    })
    .await;
}

/// The same over real HTTP: a client that hangs up while its reservation waits for another
/// writer is not charged, and its entry is not left `pending`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_while_its_reservation_waits_is_not_charged() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let account = db.account(&key).await;

    let held = hold_writes(&db, account).await;
    hang_up_after(&gateway, &key, Duration::from_millis(300)).await;
    held.commit().await.unwrap();

    let call = finished_call(db.store.as_ref(), account).await;
    assert_eq!(call.status, CallStatus::Refunded);
    assert_eq!(
        call.upstream_error.as_deref(),
        Some(CANCELLED_WHILE_RESERVING)
    );
    assert_eq!(db.balance(&key).await, balance(10, 0));
    db.assert_audit_holds().await;
    db.drop_schema().await;
}

#[tokio::test]
async fn a_client_that_hangs_up_before_the_answer_is_not_charged() {
    let provider = FakeProvider::start().await;
    provider.always(Fault::json(200, r#"{"usage":{}}"#).after(Duration::from_secs(5)));
    let catalogue =
        Catalogue::from_toml(&one_upstream_toml("slow", &provider.base, "K", "")).unwrap();
    let upstream = HttpUpstream::with_keys(&catalogue, |_| Some("k".into())).unwrap();
    let db = local_db().await;
    let gateway = start_gateway(&db, catalogue, Upstream::Http(upstream), 1 << 20).await;
    let key = db.funded_key(10, 0).await;

    hang_up_after(&gateway, &key, Duration::from_millis(500)).await;

    let account = db.account(&key).await;
    let call = finished_call(db.store.as_ref(), account).await;
    assert_eq!(call.status, CallStatus::Refunded);
    assert_eq!(db.balance(&key).await, balance(10, 0));
    db.assert_audit_holds().await;
}

/// A ledger in front of a [`MemoryStore`] that can misbehave: hold `settle` while `blocked`
/// until `released` (a call between the upstream's answer and the settle, where a client might
/// hang up or recovery step in), fail the next `failing_settles` settles, apply the next
/// `lost_settle_answers` settles and then fail them, or fail every reservation.
#[derive(Debug)]
struct TestLedger {
    inner: Arc<MemoryStore>,
    blocked: AtomicBool,
    entered: tokio::sync::Notify,
    /// Lets a settle held by `blocked` go on.
    released: tokio::sync::Notify,
    /// Settles that are applied and then answer an error, as a commit whose reply is lost.
    lost_settle_answers: std::sync::atomic::AtomicUsize,
    /// How many settles fail after one whose answer was lost (the database out a while).
    failing_after_lost_answer: std::sync::atomic::AtomicUsize,
    failing_settles: std::sync::atomic::AtomicUsize,
    failing_refunds: std::sync::atomic::AtomicUsize,
    failing_reserves: AtomicBool,
    /// Reservations wait (the database is silent) until `reserves_released`.
    blocked_reserves: AtomicBool,
    /// The next reservations are made, then answered with an error (a commit whose answer the
    /// cut connection lost).
    lost_reserve_answers: std::sync::atomic::AtomicUsize,
    reserves_released: tokio::sync::Notify,
    /// Settles are claimed for their commit before they wait (see `SettleClaim`): a commit
    /// whose answer is late.
    claims_settles: AtomicBool,
    /// Settles wait, unclaimed, until `claims_released`.
    blocked_claims: AtomicBool,
    claims_released: Arc<tokio::sync::Notify>,
}

impl TestLedger {
    fn new(inner: Arc<MemoryStore>) -> Arc<TestLedger> {
        Arc::new(TestLedger {
            inner,
            blocked: AtomicBool::new(false),
            released: tokio::sync::Notify::new(),
            lost_settle_answers: std::sync::atomic::AtomicUsize::new(0),
            failing_after_lost_answer: std::sync::atomic::AtomicUsize::new(0),
            entered: tokio::sync::Notify::new(),
            failing_settles: std::sync::atomic::AtomicUsize::new(0),
            failing_refunds: std::sync::atomic::AtomicUsize::new(0),
            failing_reserves: AtomicBool::new(false),
            blocked_reserves: AtomicBool::new(false),
            lost_reserve_answers: std::sync::atomic::AtomicUsize::new(0),
            reserves_released: tokio::sync::Notify::new(),
            claims_settles: AtomicBool::new(false),
            blocked_claims: AtomicBool::new(false),
            claims_released: Arc::new(tokio::sync::Notify::new()),
        })
    }
}

fn store_down() -> StoreError {
    StoreError::msg("connection refused (test)")
}

#[async_trait]
impl Ledger for TestLedger {
    async fn reserve(&self, request: ChargeRequest<'_>) -> Result<Reservation, ReserveError> {
        if self.failing_reserves.load(Ordering::SeqCst) {
            return Err(store_down().into());
        }
        if self.blocked_reserves.load(Ordering::SeqCst) {
            self.reserves_released.notified().await;
        }
        let reserved = self.inner.reserve(request).await;
        let lost =
            self.lost_reserve_answers
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if lost.is_ok() {
            return Err(store_down().into());
        }
        reserved
    }
    async fn settle(&self, call: CallId, success: CallSuccess) -> Result<bool, StoreError> {
        self.entered.notify_one();
        if self.blocked_claims.load(Ordering::SeqCst) {
            // Written by a task of its own, as a committer writes a queued settle whether or
            // not its caller still waits; claimed once the database answers.
            let (inner, released) = (self.inner.clone(), self.claims_released.clone());
            let write = tokio::spawn(async move {
                released.notified().await;
                if !success.claim.claim() {
                    return Ok(false);
                }
                inner.settle(call, success).await
            });
            return write.await.unwrap();
        }
        if self.claims_settles.load(Ordering::SeqCst) && !success.claim.claim() {
            // Its caller gave up first: a store that claims settles writes it never.
            return Ok(false);
        }
        if self.blocked.load(Ordering::SeqCst) {
            self.released.notified().await;
        }
        let failing = self
            .failing_settles
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if failing.is_ok() {
            return Err(store_down());
        }
        let settled = self.inner.settle(call, success).await;
        let lost = self
            .lost_settle_answers
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if lost.is_ok() {
            let outage = self.failing_after_lost_answer.load(Ordering::SeqCst);
            self.failing_settles.store(outage, Ordering::SeqCst);
            return Err(store_down());
        }
        settled
    }
    async fn refund(&self, call: CallId, failure: &CallFailure) -> Result<bool, StoreError> {
        let failing = self
            .failing_refunds
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if failing.is_ok() {
            return Err(store_down());
        }
        self.inner.refund(call, failure).await
    }
    async fn balance(&self, account: AccountId) -> Result<Balance, StoreError> {
        self.inner.balance(account).await
    }
    async fn call_status(&self, call: CallId) -> Result<Option<CallStatus>, StoreError> {
        self.inner.call_status(call).await
    }
    async fn pending_for_request(
        &self,
        account: AccountId,
        request_id: &str,
    ) -> Result<Vec<CallId>, StoreError> {
        self.inner.pending_for_request(account, request_id).await
    }
    async fn stale_reservations(
        &self,
        cutoff: chrono::DateTime<chrono::Utc>,
        limit: u64,
    ) -> Result<Vec<CallId>, StoreError> {
        self.inner.stale_reservations(cutoff, limit).await
    }
}

/// Asserts what `account` holds in all.
async fn assert_total<S: Ledger + ?Sized>(store: &S, account: AccountId, credits: i64) {
    assert_eq!(
        store.balance(account).await.unwrap().total(),
        Credits::new(credits)
    );
}

/// What the stacks below build: the layers as a service of whole request bodies.
type Stack = tower::util::BoxCloneService<
    Request<Full<Bytes>>,
    Response<model_gateway::refund::ResponseBody>,
    std::convert::Infallible,
>;

/// The four layers with `ledger` charging and settling, over the mock upstream.
fn stack_with_ledger(store: &Arc<MemoryStore>, ledger: &Arc<TestLedger>) -> Stack {
    stack_with_ledger_timeout(store, ledger, model_gateway::store::DEFAULT_LEDGER_TIMEOUT)
}

/// [`stack_with_ledger`], waiting at most `timeout` for the ledger's reservations and settles.
fn stack_with_ledger_timeout(
    store: &Arc<MemoryStore>,
    ledger: &Arc<TestLedger>,
    timeout: Duration,
) -> Stack {
    Stack::new(
        ServiceBuilder::new()
            .layer(model_gateway::request_id::RequestIdLayer::new())
            .layer(ApiKeyAuthLayer::new(store.clone()))
            .layer(ProtocolRouterLayer::new(Arc::new(Catalogue::demo())))
            .layer(CreditChargeLayer::new(ledger.clone()).ledger_timeout(timeout))
            .layer(RefundOnUpstreamErrorLayer::new(ledger.clone()).ledger_timeout(timeout))
            .service(model_gateway::upstream::MockUpstream::new()),
    )
}

#[tokio::test]
async fn a_call_dropped_after_the_upstream_answered_is_billed() {
    let (store, ledger, account, key) = ledger_on_memory(10).await;
    ledger.blocked.store(true, Ordering::SeqCst);
    let service = stack_with_ledger(&store, &ledger);

    let call = tokio::spawn(service.oneshot(chat_request(&key)));
    ledger.entered.notified().await; // the upstream answered; settling has begun
    ledger.blocked.store(false, Ordering::SeqCst);
    call.abort(); // the client hangs up before the reply is sent

    let call = finished_call(store.as_ref(), account).await;
    assert_eq!(call.status, CallStatus::Ok);
    assert_total(&*store, account, 10 - CHAT_PRICE).await;
}

/// A settle whose commit is on its way when the call stops waiting for it (the store claimed
/// it, its answer late): the call is billed, so its client gets the reply it pays for, not a
/// `503` that would invite a second charge; the settle finishes once the ledger answers.
#[tokio::test]
async fn a_settle_claimed_by_its_commit_before_the_time_out_is_billed_and_its_reply_handed_out() {
    let (store, ledger, account, key) = ledger_on_memory(10).await;
    ledger.claims_settles.store(true, Ordering::SeqCst);
    ledger.blocked.store(true, Ordering::SeqCst);
    let service = stack_with_ledger_timeout(&store, &ledger, Duration::from_millis(200));
    let response = service.oneshot(chat_request(&key)).await.unwrap();
    assert_eq!(
        response.status(),
        200,
        "a claimed settle's reply was withheld"
    );
    assert_eq!(
        response.headers()["x-gateway-credits"],
        CHAT_PRICE.to_string().as_str()
    );
    ledger.released.notify_one();
    let call = finished_call(store.as_ref(), account).await;
    assert_eq!(call.status, CallStatus::Ok);
    assert_total(&*store, account, 10 - CHAT_PRICE).await;
}

/// The same late ledger, not claimed when the call gives up: `503`, and the settle that comes
/// later writes nothing, so the call is refunded whole.
#[tokio::test]
async fn a_settle_given_up_before_its_commit_claims_it_is_refunded_whole() {
    let (store, ledger, account, key) = ledger_on_memory(10).await;
    // The settle waits before it claims: held while the call gives up.
    ledger.blocked_claims.store(true, Ordering::SeqCst);
    let service = stack_with_ledger_timeout(&store, &ledger, Duration::from_millis(200));
    let response = service.oneshot(chat_request(&key)).await.unwrap();
    assert_eq!(response.status(), 503);
    // The late settle is written now, before the background refund can be: it finds its
    // claim abandoned and writes nothing.
    ledger.claims_released.notify_waiters();
    let call = finished_call(store.as_ref(), account).await;
    assert_eq!(call.status, CallStatus::Refunded);
    assert_total(&*store, account, 10).await;
}

/// Recovery refunds a call while its upstream is still answering (its age was set shorter than
/// the call lasted): the settle then finds the entry refunded, and the reply is not handed out.
/// Handing it out would be a free reply.
#[tokio::test]
async fn a_call_refunded_by_recovery_while_its_upstream_answered_gets_no_reply() {
    let (store, ledger, account, key) = ledger_on_memory(10).await;
    ledger.blocked.store(true, Ordering::SeqCst);
    let call = tokio::spawn(stack_with_ledger(&store, &ledger).oneshot(chat_request(&key)));
    ledger.entered.notified().await; // the upstream answered; the settle is held

    let refunded = recover_stale_reservations(store.as_ref(), Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(refunded.len(), 1);
    ledger.released.notify_one();
    let response = call.await.unwrap().unwrap();

    assert_eq!(
        response.status(),
        502,
        "a refunded call's reply was handed out"
    );
    let calls = store.recent_calls(account, 10).await.unwrap();
    assert_eq!(calls[0].status, CallStatus::Refunded);
    assert_total(&*store, account, 10).await;
}

/// One call through a ledger that `misbehave` sets up: answered 200, its entry `ok`, billed once.
async fn assert_answered_and_billed_once(misbehave: impl FnOnce(&TestLedger)) {
    let (store, ledger, account, key) = ledger_on_memory(10).await;
    misbehave(&ledger);

    let response = stack_with_ledger(&store, &ledger)
        .oneshot(chat_request(&key))
        .await
        .unwrap();

    assert_eq!(response.status(), 200);
    assert_eq!(
        store.recent_calls(account, 10).await.unwrap()[0].status,
        CallStatus::Ok
    );
    assert_total(&*store, account, 10 - CHAT_PRICE).await;
}

/// A settle whose first attempt landed but whose answer was lost is billed once and answered:
/// the retry finds the entry `ok`.
#[tokio::test]
async fn a_settle_that_landed_but_failed_to_answer_is_billed_once_and_replied() {
    assert_answered_and_billed_once(|ledger| {
        ledger.lost_settle_answers.store(1, Ordering::SeqCst);
    })
    .await;
}

/// The same, with the database out for 2.3 s after the lost answer (past the quick retries,
/// within the 5 s ledger time-out): the settle is retried until it finds the entry billed, and
/// the client gets its reply, never a 503 for a billed call.
#[tokio::test]
async fn a_settle_that_landed_before_an_outage_shorter_than_the_time_out_is_replied() {
    assert_answered_and_billed_once(|ledger| {
        ledger.lost_settle_answers.store(1, Ordering::SeqCst);
        ledger.failing_after_lost_answer.store(4, Ordering::SeqCst);
    })
    .await;
}

#[tokio::test]
async fn a_settle_that_fails_for_a_moment_is_retried_and_billed_once() {
    assert_answered_and_billed_once(|ledger| ledger.failing_settles.store(2, Ordering::SeqCst))
        .await;
}

/// A settle the ledger does not take in time: the client gets 503 and no reply, and the call
/// is refunded in the background once the ledger answers, on a live gateway, with no recovery
/// run (recovery never touches a live lease's reservations). Here the refund too fails 3 times
/// (0.25 + 1 + 2 s of pauses) before it lands.
#[tokio::test]
async fn a_settle_not_written_in_time_answers_503_and_is_refunded_once_the_ledger_answers() {
    let (store, ledger, account, key) = ledger_on_memory(10).await;
    ledger.failing_settles.store(usize::MAX, Ordering::SeqCst);
    ledger.failing_refunds.store(3, Ordering::SeqCst);
    let stack = stack_with_ledger_timeout(&store, &ledger, Duration::from_millis(500));

    let started = std::time::Instant::now();
    let response = stack.oneshot(chat_request(&key)).await.unwrap();
    assert_eq!(response.status(), 503, "no reply without a settled bill");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "answered within the ledger time-out"
    );
    assert_eq!(
        store.recent_calls(account, 10).await.unwrap()[0].status,
        CallStatus::Pending
    );

    let call = finished_call(store.as_ref(), account).await;
    assert_eq!(
        call.status,
        CallStatus::Refunded,
        "refunded without a restart or recovery"
    );
    assert_eq!(
        call.upstream_error.as_deref(),
        Some(model_gateway::refund::SETTLE_NOT_WRITTEN)
    );
    assert_eq!(
        ledger.failing_refunds.load(Ordering::SeqCst),
        0,
        "the refund was retried"
    );
    assert_total(&*store, account, 10).await;
}

/// A store that never answers a reservation: the client gets 503 within the ledger time-out.
#[tokio::test]
async fn a_reservation_the_store_never_answers_is_a_503_within_the_ledger_time_out() {
    let (store, ledger, account, key) = ledger_on_memory(10).await;
    ledger.blocked_reserves.store(true, Ordering::SeqCst);
    let stack = stack_with_ledger_timeout(&store, &ledger, Duration::from_millis(300));

    let started = std::time::Instant::now();
    let response = stack.oneshot(chat_request(&key)).await.unwrap();
    assert_eq!(response.status(), 503);
    assert!(started.elapsed() < Duration::from_secs(2));
    // The reservation lands once the store answers, and is refunded at once.
    ledger.blocked_reserves.store(false, Ordering::SeqCst);
    ledger.reserves_released.notify_waiters();
    let call = finished_call(store.as_ref(), account).await;
    let calls = store.recent_calls(account, 10).await.unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(call.status, CallStatus::Refunded);
    assert_total(&*store, account, 10).await;
}

/// A reservation the store made but whose answer was lost (the connection cut just after the
/// commit): its client is answered 503, and the entry is found by the request's id and
/// refunded, not left held by no call under a live lease.
#[tokio::test]
async fn a_reservation_whose_answer_was_lost_is_found_by_its_request_id_and_refunded() {
    let (store, ledger, account, key) = ledger_on_memory(10).await;
    ledger.lost_reserve_answers.store(1, Ordering::SeqCst);

    let response = stack_with_ledger(&store, &ledger)
        .oneshot(chat_request(&key))
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    let call = finished_call(store.as_ref(), account).await;
    assert_eq!(call.status, CallStatus::Refunded);
    assert_eq!(
        call.upstream_error.as_deref(),
        Some(model_gateway::charge::RESERVATION_ANSWER_LOST)
    );
    assert_total(&*store, account, 10).await;
}

#[tokio::test]
async fn an_unreachable_store_at_reservation_answers_503_and_charges_nothing() {
    let (store, ledger, account, key) = ledger_on_memory(10).await;
    ledger.failing_reserves.store(true, Ordering::SeqCst);

    let response = stack_with_ledger(&store, &ledger)
        .oneshot(chat_request(&key))
        .await
        .unwrap();

    assert_eq!(response.status(), 503);
    assert!(store.recent_calls(account, 10).await.unwrap().is_empty());
    assert_total(&*store, account, 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_connections_cut_mid_call_lose_nothing_and_charge_once() {
    let Some(db) = postgres_db().await else {
        return;
    };
    let provider = FakeProvider::start().await;
    provider.always(Fault::json(200, r#"{"usage":{}}"#).after(Duration::from_millis(800)));
    let catalogue =
        Catalogue::from_toml(&one_upstream_toml("slow", &provider.base, "K", "")).unwrap();
    let upstream = HttpUpstream::with_keys(&catalogue, |_| Some("k".into())).unwrap();
    let gateway = start_gateway(&db, catalogue, Upstream::Http(upstream), 1 << 20).await;
    let key = db.funded_key(20, 0).await;

    let calls: Vec<_> = (0..4)
        .map(|_| {
            let (client, url, key) = (
                gateway.client.clone(),
                format!("{}{CHAT}", gateway.base),
                key.clone(),
            );
            tokio::spawn(async move { chat_status(&client, &url, &key).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await; // reserved, waiting on the provider
    let admin = sea_orm::Database::connect(&db.url).await.unwrap();
    let killed = admin
        .execute_unprepared(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = '{}'",
            db.pg_schema().unwrap()
        ))
        .await
        .unwrap();
    assert!(killed.rows_affected() > 0, "no gateway connection was cut");

    let mut statuses = Vec::new();
    for call in calls {
        statuses.push(call.await.unwrap());
    }
    // Each call either completed and was billed once, or answered a clear 5xx and is pending
    // for recovery; none is lost and none charged twice.
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 503),
        "{statuses:?}"
    );
    let ok = statuses.iter().filter(|s| **s == 200).count() as i64;
    recover_stale_reservations(db.store.as_ref(), Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(db.balance(&key).await.total().get(), 20 - ok * CHAT_PRICE);
    db.assert_audit_holds().await;
    // And the gateway serves again, without a restart.
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    drop(gateway);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_panicking_upstream_is_refunded_and_answers_502() {
    let (store, account, key) = funded_memory(10).await;
    let panics = service_fn(|_: Request<Bytes>| async {
        if true {
            panic!("upstream bug");
        }
        Ok::<Response<Bytes>, UpstreamError>(Response::new(Bytes::new()))
    });
    let service = model_gateway::stack(store.clone(), Arc::new(Catalogue::demo()), 1 << 20, panics);

    let response = service.oneshot(chat_request(&key)).await.unwrap();

    assert_eq!(response.status(), 502);
    let call = finished_call(store.as_ref(), account).await;
    assert_eq!(call.status, CallStatus::Refunded);
    assert!(call.upstream_error.unwrap().contains("upstream bug"));
    assert_total(&*store, account, 10).await;
}

#[tokio::test]
async fn an_upstream_that_never_answers_is_refunded_at_the_bound() {
    let (store, account, key) = funded_memory(10).await;
    let service = ServiceBuilder::new()
        .layer(ApiKeyAuthLayer::new(store.clone()))
        .layer(ProtocolRouterLayer::new(Arc::new(Catalogue::demo())))
        .layer(CreditChargeLayer::new(store.clone()))
        .layer(
            RefundOnUpstreamErrorLayer::new(store.clone())
                .upstream_bound(Duration::from_millis(300)),
        )
        .service(never_answers());

    let response = service.oneshot(chat_request(&key)).await.unwrap();

    assert_eq!(response.status(), 502);
    assert_total(&*store, account, 10).await;
    let call = store.recent_calls(account, 1).await.unwrap().remove(0);
    assert_eq!(call.status, CallStatus::Refunded);
}

// ---------------------------------------------------------------------------------------------
// Streams: the same guarantees when the call's outcome is decided as its body ends

const STREAM_EVENTS: [&str; 3] = [
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n",
    "data: [DONE]\n\n",
];

fn stream_request(key: &str) -> Request<Full<Bytes>> {
    let body = serde_json::json!({
        "model": CHAT_MODEL, "stream": true, "messages": [{ "role": "user", "content": "Hi" }]
    });
    Request::post(CHAT)
        .header("authorization", format!("Bearer {key}"))
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

/// An upstream whose every answer is `events` as an event stream.
fn streams<B, F>(
    events: F,
) -> impl tower::Service<
    Request<Bytes>,
    Response = Response<UpstreamBody>,
    Error = UpstreamError,
    Future = impl Send,
> + Clone
+ Send
+ 'static
where
    F: Fn() -> B + Clone + Send + 'static,
    B: http_body::Body<Data = Bytes, Error = UpstreamError> + Send + 'static,
{
    service_fn(move |_: Request<Bytes>| {
        let body = events();
        async move { Ok::<_, UpstreamError>(Response::new(UpstreamBody::events(body))) }
    })
}

/// The `STREAM_EVENTS` as a body, all there at once.
fn good_stream() -> impl http_body::Body<Data = Bytes, Error = UpstreamError> + Send + 'static {
    use http_body_util::BodyExt;
    http_body_util::StreamBody::new(futures::stream::iter(
        STREAM_EVENTS.map(|event| Ok(http_body::Frame::data(Bytes::from(event)))),
    ))
    .map_err(|never: std::convert::Infallible| match never {})
}

/// The four layers with streaming on, `ledger` charging and settling, over `upstream`.
fn streaming_stack<U>(store: &Arc<MemoryStore>, ledger: Arc<dyn Ledger>, upstream: U) -> Stack
where
    U: tower::Service<Request<Bytes>, Response = Response<UpstreamBody>, Error = UpstreamError>
        + Clone
        + Send
        + 'static,
    U::Future: Send,
{
    Stack::new(
        ServiceBuilder::new()
            .layer(ApiKeyAuthLayer::new(store.clone()))
            .layer(ProtocolRouterLayer::new(Arc::new(
                Catalogue::demo().with_streaming(true),
            )))
            .layer(CreditChargeLayer::new(ledger.clone()))
            .layer(RefundOnUpstreamErrorLayer::new(ledger))
            .service(upstream),
    )
}

async fn read_all(response: Response<model_gateway::refund::ResponseBody>) -> String {
    use http_body_util::BodyExt;
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// A stream that sends its first event, then panics on the next poll.
struct PanicsAfterOneEvent(bool);

impl http_body::Body for PanicsAfterOneEvent {
    type Data = Bytes;
    type Error = UpstreamError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, UpstreamError>>> {
        if std::mem::replace(&mut self.0, true) {
            panic!("the provider's stream panicked (test)");
        }
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from(
            STREAM_EVENTS[0].to_owned() + STREAM_EVENTS[1],
        )))))
    }
}

#[tokio::test]
async fn a_stream_whose_provider_panics_mid_way_is_refunded_and_ends_with_an_error_event() {
    let (store, account, key) = funded_memory(10).await;
    let service = streaming_stack(
        &store,
        store.clone(),
        streams(|| PanicsAfterOneEvent(false)),
    );

    let response = service.oneshot(stream_request(&key)).await.unwrap();
    assert_eq!(response.status(), 200);
    let text = read_all(response).await;

    let error_event = "data: {\"error\":{\"code\":null,\"message\":\"上游服务暂时不可用\",\"type\":\"api_error\"}}\n\n";
    assert_eq!(
        text,
        STREAM_EVENTS[0].to_owned() + STREAM_EVENTS[1] + error_event
    );
    let call = finished_call(store.as_ref(), account).await;
    assert_eq!(call.status, CallStatus::Refunded);
    assert!(call.upstream_error.unwrap().contains("panicked"));
    assert_total(&*store, account, 10).await;
}

#[tokio::test]
async fn a_stream_dropped_before_it_was_read_is_refunded() {
    let (store, account, key) = funded_memory(10).await;
    let service = streaming_stack(&store, store.clone(), streams(good_stream));

    let response = service.oneshot(stream_request(&key)).await.unwrap();
    assert_eq!(response.status(), 200);
    drop(response);

    let call = finished_call(store.as_ref(), account).await;
    assert_eq!(call.status, CallStatus::Refunded);
    assert_eq!(
        call.upstream_error.as_deref(),
        Some(model_gateway::refund::CLIENT_LEFT_BEFORE_CONTENT)
    );
    assert_total(&*store, account, 10).await;
}

/// One stream through a ledger that `misbehave` sets up: every event arrives, its entry ends
/// `ok`, billed once.
async fn assert_streamed_and_billed_once(misbehave: impl FnOnce(&TestLedger)) {
    let (store, ledger, account, key) = ledger_on_memory(10).await;
    misbehave(&ledger);
    let service = streaming_stack(&store, ledger, streams(good_stream));

    let response = service.oneshot(stream_request(&key)).await.unwrap();
    assert_eq!(read_all(response).await, STREAM_EVENTS.concat());

    let calls = store.recent_calls(account, 10).await.unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].status, CallStatus::Ok);
    assert_total(&*store, account, 10 - CHAT_PRICE).await;
}

/// A Responses stream (the mock's, translated from its chat stream) through a ledger that
/// `misbehave` sets up: it ends with `response.completed`, its entry `ok`, billed once.
async fn assert_a_responses_stream_is_billed_once(misbehave: impl FnOnce(&TestLedger)) {
    let (store, ledger, account, key) = ledger_on_memory(10).await;
    misbehave(&ledger);
    let service = streaming_stack(&store, ledger, model_gateway::upstream::MockUpstream::new());
    let body = serde_json::json!({ "model": CHAT_MODEL, "stream": true, "input": "Hi" });
    let request = Request::post("/v1/responses")
        .header("authorization", format!("Bearer {key}"))
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();

    let response = service.oneshot(request).await.unwrap();
    let text = read_all(response).await;
    assert!(text.starts_with("event: response.created\n"), "{text}");
    assert!(
        text.trim_end()
            .rsplit("\n\n")
            .next()
            .unwrap()
            .starts_with("event: response.completed\n"),
        "{text}"
    );
    let calls = store.recent_calls(account, 10).await.unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(
        (calls[0].protocol, calls[0].status),
        (model_gateway::Protocol::Responses, CallStatus::Ok)
    );
    assert_total(&*store, account, 10 - CHAT_PRICE).await;
}

#[tokio::test]
async fn a_responses_streams_settle_that_fails_for_a_moment_is_retried_and_billed_once() {
    assert_a_responses_stream_is_billed_once(|ledger| {
        ledger.failing_settles.store(2, Ordering::SeqCst);
    })
    .await;
}

#[tokio::test]
async fn a_responses_streams_settle_that_landed_but_lost_its_answer_is_billed_once() {
    assert_a_responses_stream_is_billed_once(|ledger| {
        ledger.lost_settle_answers.store(1, Ordering::SeqCst);
    })
    .await;
}

#[tokio::test]
async fn a_streams_settle_that_fails_for_a_moment_is_retried_and_billed_once() {
    assert_streamed_and_billed_once(|ledger| ledger.failing_settles.store(2, Ordering::SeqCst))
        .await;
}

#[tokio::test]
async fn a_streams_settle_that_landed_but_lost_its_answer_is_billed_once() {
    assert_streamed_and_billed_once(|ledger| {
        ledger.lost_settle_answers.store(1, Ordering::SeqCst);
    })
    .await;
}

#[tokio::test]
async fn a_stream_dropped_while_its_settle_is_under_way_is_billed_once() {
    let (store, ledger, account, key) = ledger_on_memory(10).await;
    ledger.blocked.store(true, Ordering::SeqCst);
    let service = streaming_stack(&store, ledger.clone(), streams(good_stream));

    let response = service.oneshot(stream_request(&key)).await.unwrap();
    let reading = tokio::spawn(read_all(response));
    ledger.entered.notified().await; // the final event passed; settling has begun
    ledger.blocked.store(false, Ordering::SeqCst);
    reading.abort(); // the client hangs up before its stream ends

    let call = finished_call(store.as_ref(), account).await;
    assert_eq!(call.status, CallStatus::Ok);
    assert_total(&*store, account, 10 - CHAT_PRICE).await;
}

// ---------------------------------------------------------------------------------------------
// Recovery

/// Makes a reservation look `age` old, as if its gateway had died that long ago.
async fn backdate(db: &TestDb, call: CallId, age: Duration) {
    use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
    let when = chrono::Utc::now() - chrono::Duration::from_std(age).unwrap();
    let statement = Query::update()
        .table(Alias::new("mg_calls"))
        .value(Alias::new("created_at"), when)
        .and_where(Expr::col(Alias::new("id")).eq(call.0))
        .to_owned();
    let connection = db.store.connection();
    let built = connection.get_database_backend().build(&statement);
    assert_eq!(
        connection.execute_raw(built).await.unwrap().rows_affected(),
        1
    );
}

/// A charge for one call to the chat model, as `CreditCharge` makes it.
fn chat_charge(caller: model_gateway::store::Caller) -> ChargeRequest<'static> {
    ChargeRequest::new(
        caller,
        model_gateway::Protocol::ChatCompletions,
        CHAT_MODEL,
        Credits::new(CHAT_PRICE),
    )
}

async fn reserve(db: &TestDb, key: &str) -> Reservation {
    let caller = db.caller(key).await;
    db.store.reserve(chat_charge(caller)).await.unwrap()
}

async fn assert_recovery_refunds_only_old_reservations(db: TestDb) {
    let key = db.funded_key(3, 10).await;
    let stale = reserve(&db, &key).await;
    let live = reserve(&db, &key).await;
    backdate(&db, stale.call, Duration::from_secs(3600)).await;

    let refunded = recover_stale_reservations(db.store.as_ref(), Duration::from_secs(600))
        .await
        .unwrap();

    assert_eq!(refunded, [stale.call]);
    // The stale call took 2 subscription credits; the live one 1 + 1. Only the first came back.
    assert_eq!(db.balance(&key).await, balance(2, 9));
    let calls = db.calls(&key).await;
    let status_of = |id: CallId| calls.iter().find(|c| c.id == id).unwrap().status;
    assert_eq!(
        (status_of(stale.call), status_of(live.call)),
        (CallStatus::Refunded, CallStatus::Pending)
    );
    let reason = calls
        .iter()
        .find(|c| c.id == stale.call)
        .unwrap()
        .upstream_error
        .clone();
    assert!(reason.unwrap().starts_with("recovered"));
    let again = recover_stale_reservations(db.store.as_ref(), Duration::from_secs(600))
        .await
        .unwrap();
    assert!(again.is_empty(), "a second pass refunds nothing");
    db.assert_audit_holds().await;
    db.drop_schema().await;
}

backends!(
    async fn recovery_refunds_only_reservations_older_than_the_age(db) {
        assert_recovery_refunds_only_old_reservations(db).await;
    }
);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_recovering_at_once_refund_each_reservation_once() {
    let Some(db) = postgres_db().await else {
        return;
    };
    let key = db.funded_key(100, 0).await;
    let mut stale = Vec::new();
    for _ in 0..40 {
        let reservation = reserve(&db, &key).await;
        backdate(&db, reservation.call, Duration::from_secs(3600)).await;
        stale.push(reservation.call);
    }
    let other = Arc::new(postgres_store(&db.url, db.pg_schema().unwrap()).await);
    let age = Duration::from_secs(600);
    let (mine, theirs) = tokio::join!(
        recover_stale_reservations(db.store.as_ref(), age),
        recover_stale_reservations(other.as_ref(), age),
    );
    let (mine, theirs) = (mine.unwrap(), theirs.unwrap());

    assert_eq!(mine.len() + theirs.len(), 40, "each refunded exactly once");
    assert!(mine.iter().all(|call| !theirs.contains(call)));
    assert_eq!(db.balance(&key).await, balance(100, 0));
    db.assert_audit_holds().await;
    db.drop_schema().await;
}

// ---------------------------------------------------------------------------------------------
// Audit and revocation

#[tokio::test]
async fn the_audit_passes_on_honest_books_and_names_the_account_that_does_not_balance() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let honest = db.funded_key(5, 5).await;
    let tampered = db.funded_key(5, 5).await;
    for key in [&honest, &tampered] {
        assert_eq!(gateway.chat(key, CHAT_MODEL).await.status, 200);
    }
    let report = db.admin().audit().await.unwrap();
    assert_eq!((report.accounts.len(), report.ok), (2, true));

    // Credits that appear without a grant.
    let account = db.account(&tampered).await;
    let sql = format!(
        "UPDATE mg_accounts SET topup_credits = topup_credits + 1 WHERE id = {}",
        account.0
    );
    db.store
        .connection()
        .execute_unprepared(&sql)
        .await
        .unwrap();

    let report = db.admin().audit().await.unwrap();
    assert!(!report.ok);
    let failed: Vec<_> = report
        .accounts
        .iter()
        .filter(|line| line["ok"] == false)
        .collect();
    assert_eq!(failed[0]["account"], account.0);
}

#[tokio::test]
async fn a_revoked_key_is_refused_on_its_next_call_on_every_gateway() {
    let db = local_db().await;
    let other = db.second_instance().await;
    let gateways = [
        start_mock_gateway(&db).await,
        start_mock_gateway(&other).await,
    ];
    let key = db.funded_key(100, 0).await;
    for gateway in &gateways {
        assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    }

    db.admin().revoke_clear_key(&key).await.unwrap();

    for gateway in &gateways {
        let answer = gateway.messages(&key, MESSAGES_MODEL).await;
        assert_eq!((answer.status, answer.detail()), (401, "无效的 API Key"));
    }
    assert!(
        db.admin().revoke_clear_key(&key).await.is_err(),
        "already revoked"
    );
}

// ---------------------------------------------------------------------------------------------
// The database out of reach: refused, or silent, between the gateway and PostgreSQL.

/// A gateway on the test `PostgreSQL` reached through a [`DbProxy`], holding a lease (a live
/// gateway: recovery never touches its reservations), calling a provider that answers after
/// `delay`; with escrow when asked.
struct ProxiedGateway {
    db: TestDb,
    proxy: common::db_proxy::DbProxy,
    store: Arc<model_gateway::SeaOrmStore>,
    gateway: Gateway,
    _provider: FakeProvider,
    upkeep: Option<model_gateway::recovery::UpkeepHandle<model_gateway::SeaOrmStore>>,
}

async fn proxied_postgres_gateway(delay: Duration, escrow: bool) -> Option<ProxiedGateway> {
    proxied_postgres_gateway_with_lease(delay, escrow, Duration::from_secs(30)).await
}

async fn proxied_postgres_gateway_with_lease(
    delay: Duration,
    escrow: bool,
    lease: Duration,
) -> Option<ProxiedGateway> {
    let url = postgres_url()?;
    let db = postgres_db().await?;
    let server = common::db_proxy::server_of(&url);
    let proxy = common::db_proxy::DbProxy::start(server.clone()).await;
    let mut store = postgres_store(&proxy.url(&url, &server), db.pg_schema().unwrap()).await;
    if escrow {
        store = store.with_escrow().unwrap();
    }
    let store = Arc::new(store);
    let upkeep = model_gateway::recovery::Upkeep::new(store.clone(), Duration::from_secs(600))
        .lease_ttl(lease)
        .start()
        .await
        .unwrap();
    let provider = FakeProvider::start().await;
    provider.always(Fault::json(200, r#"{"usage":{}}"#).after(delay));
    let catalogue =
        Catalogue::from_toml(&one_upstream_toml("slow", &provider.base, "K", "")).unwrap();
    let through_proxy = TestDb::sharing(&db, store.clone());
    let gateway = http_gateway(&through_proxy, catalogue).await;
    Some(ProxiedGateway {
        db,
        proxy,
        store,
        gateway,
        _provider: provider,
        upkeep: Some(upkeep),
    })
}

impl ProxiedGateway {
    /// Waits (up to `within`) until the schema has at least `entries` finished entries and
    /// none `pending` (an escrowed call has none until it ends); how many are not finished
    /// then.
    async fn unfinished_after(&self, entries: i64, within: Duration) -> i64 {
        let started = std::time::Instant::now();
        loop {
            let row = self
                .db
                .store
                .connection()
                .query_one_raw(sea_orm::Statement::from_string(
                    sea_orm::DbBackend::Postgres,
                    "SELECT COUNT(*) FILTER (WHERE status <> 'pending') AS finished, \
                     COUNT(*) FILTER (WHERE status = 'pending') AS pending FROM mg_calls",
                ))
                .await
                .unwrap()
                .unwrap();
            let finished: i64 = row.try_get("", "finished").unwrap();
            let pending: i64 = row.try_get("", "pending").unwrap();
            let unfinished = pending + (entries - finished).max(0);
            if unfinished == 0 || started.elapsed() > within {
                return unfinished;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn finish(mut self) {
        if let Some(upkeep) = self.upkeep.take() {
            upkeep.stop().await;
        }
        drop(self.gateway);
        drop(self.store);
        drop(self.proxy);
        self.db.drop_schema().await;
    }
}

/// Finding 1 of the fault run: `PostgreSQL` refused for a few seconds while 8 clients' calls are
/// at a slow provider. Their settles cannot be written: each client gets 503 within the ledger
/// time-out, and once the database answers again every entry ends `refunded` within seconds,
/// on the live gateway, with no restart and no recovery run; every balance view agrees.
async fn refused_mid_call_every_reservation_ends(escrow: bool) {
    let Some(rig) = proxied_postgres_gateway(Duration::from_millis(1500), escrow).await else {
        return;
    };
    let key = rig.db.funded_key(1000, 0).await;
    assert_eq!(rig.gateway.chat(&key, CHAT_MODEL).await.status, 200);
    let before = rig.db.balance(&key).await;

    let calls = (0..8).map(|_| rig.gateway.chat(&key, CHAT_MODEL));
    let calls = futures::future::join_all(calls);
    let refusing = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        rig.proxy.set(common::db_proxy::Passage::Refused);
    };
    let started = std::time::Instant::now();
    let (answers, ()) = tokio::join!(calls, refusing);
    let answered_in = started.elapsed();
    rig.proxy.set(common::db_proxy::Passage::Open);
    for answer in &answers {
        assert_eq!(answer.status, 503, "{answer:?}");
    }
    assert!(
        answered_in < Duration::from_secs(9),
        "answered in {answered_in:?}"
    );

    let unfinished = rig.unfinished_after(9, Duration::from_secs(15)).await;
    assert_eq!(unfinished, 0, "nothing held by nothing");
    let calls = rig.db.calls(&key).await;
    let refunded = calls
        .iter()
        .filter(|call| call.status == CallStatus::Refunded)
        .count();
    assert_eq!(refunded, 8, "{calls:#?}");
    assert_eq!(rig.db.balance(&key).await, before, "the database's balance");
    let through_gateway = rig.gateway.send(
        rig.gateway
            .client
            .get(format!("{}/v1/balance", rig.gateway.base))
            .bearer_auth(&key),
    );
    let through_gateway = through_gateway.await;
    assert_eq!(through_gateway.status, 200);
    assert_eq!(
        through_gateway.body["total"].as_i64(),
        Some(before.total().get()),
        "the key holder's balance agrees: {:?}",
        through_gateway.body
    );
    assert_eq!(
        rig.gateway.chat(&key, CHAT_MODEL).await.status,
        200,
        "serving again"
    );
    rig.db.assert_audit_holds().await;
    rig.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_refused_mid_call_every_reservation_ends_on_a_live_gateway() {
    refused_mid_call_every_reservation_ends(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_escrow_refused_mid_call_every_reservation_ends_and_balances_agree() {
    refused_mid_call_every_reservation_ends(true).await;
}

/// Finding 2 of the fault run: a database that stops answering (nothing refused) makes calls
/// and the key holders' endpoints `503` within the ledger time-out instead of hanging; once it
/// answers again, what was reserved meanwhile ends and the books balance.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_gone_silent_answers_503_within_the_ledger_time_out() {
    let Some(rig) = proxied_postgres_gateway(Duration::ZERO, false).await else {
        return;
    };
    let key = rig.db.funded_key(1000, 0).await;
    assert_eq!(rig.gateway.chat(&key, CHAT_MODEL).await.status, 200);
    let before = rig.db.balance(&key).await;

    rig.proxy.set(common::db_proxy::Passage::Silent);
    let started = std::time::Instant::now();
    let calls = futures::future::join_all((0..4).map(|_| rig.gateway.chat(&key, CHAT_MODEL)));
    let balance = rig.gateway.send(
        rig.gateway
            .client
            .get(format!("{}/v1/balance", rig.gateway.base))
            .bearer_auth(&key),
    );
    let (calls, balance) = tokio::join!(calls, balance);
    let answered_in = started.elapsed();
    for answer in calls.iter().chain([&balance]) {
        assert_eq!(answer.status, 503, "{answer:?}");
        assert!(!answer.detail().is_empty());
    }
    let bound = model_gateway::store::DEFAULT_LEDGER_TIMEOUT + Duration::from_secs(2);
    assert!(answered_in < bound, "answered in {answered_in:?}");

    tokio::time::sleep(Duration::from_secs(2)).await;
    rig.proxy.set(common::db_proxy::Passage::Open);
    // The four calls' reservations land once the database answers, and end.
    assert_eq!(rig.unfinished_after(5, Duration::from_secs(15)).await, 0);
    // A call answered 503 is never billed, however late its writes land (`SettleClaim`).
    let calls = rig.db.calls(&key).await;
    let billed = calls
        .iter()
        .filter(|call| call.status == CallStatus::Ok)
        .count() as i64;
    let late = billed - 1;
    assert_eq!(late, 0, "{calls:#?}");
    let expected = before.total().get() - late * CHAT_PRICE;
    assert_eq!(
        rig.db.balance(&key).await.total().get(),
        expected,
        "{calls:#?}"
    );
    assert_eq!(
        rig.gateway.chat(&key, CHAT_MODEL).await.status,
        200,
        "serving again"
    );
    rig.db.assert_audit_holds().await;
    rig.finish().await;
}

/// Issue 67, finding 1: `PostgreSQL` goes silent while six calls' upstreams answer, for longer
/// than the ledger time-out. A call answered `503` is never billed (the adversarial run: 6 of
/// 6 billed once the database answered), and a call billed is one whose reply was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_silent_while_calls_settle_bills_no_503() {
    let Some(rig) = proxied_postgres_gateway(Duration::from_millis(800), false).await else {
        return;
    };
    let key = rig.db.funded_key(1000, 0).await;
    assert_eq!(rig.gateway.chat(&key, CHAT_MODEL).await.status, 200);
    let before = rig.db.balance(&key).await;

    let calls = futures::future::join_all((0..6).map(|_| rig.gateway.chat(&key, CHAT_MODEL)));
    let silence = async {
        // Reserved by now; their upstreams answer at 800 ms, into the silence.
        tokio::time::sleep(Duration::from_millis(300)).await;
        rig.proxy.set(common::db_proxy::Passage::Silent);
    };
    let (answers, ()) = tokio::join!(calls, silence);
    tokio::time::sleep(Duration::from_secs(2)).await;
    rig.proxy.set(common::db_proxy::Passage::Open);
    assert_eq!(rig.unfinished_after(7, Duration::from_secs(20)).await, 0);

    let replied = answers.iter().filter(|answer| answer.status == 200).count() as i64;
    assert!(
        answers
            .iter()
            .all(|answer| [200, 503].contains(&answer.status)),
        "{answers:?}"
    );
    let calls = rig.db.calls(&key).await;
    let billed = calls
        .iter()
        .filter(|call| call.status == CallStatus::Ok)
        .count() as i64;
    assert_eq!(billed, 1 + replied, "billed without a reply: {calls:#?}");
    assert_eq!(
        rig.db.balance(&key).await.total().get(),
        before.total().get() - replied * CHAT_PRICE
    );
    rig.db.assert_audit_holds().await;
    rig.finish().await;
}

/// Finding 3 of the fault run: `PostgreSQL` refused for 3 s against a 5 s lease, while 4 clients
/// call without pause. The lease is kept (renewed as soon as the database answers, never
/// taken anew), and no call is withheld: every answer is 200 (billed once) or 503 (never
/// billed), none 502, and no entry is refunded for a lease that ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_refused_for_less_than_the_lease_keeps_it_and_withholds_no_call() {
    let rig = proxied_postgres_gateway_with_lease(Duration::ZERO, false, Duration::from_secs(5));
    let Some(rig) = rig.await else {
        return;
    };
    let key = rig.db.funded_key(100_000, 0).await;
    let stop = Arc::new(AtomicBool::new(false));
    let clients = (0..4).map(|_| {
        let (gateway, key, stop) = (&rig.gateway, key.clone(), stop.clone());
        async move {
            let mut statuses = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let started = std::time::Instant::now();
                let status = gateway.chat(&key, CHAT_MODEL).await.status;
                statuses.push((status, started.elapsed()));
            }
            statuses
        }
    });
    let outage = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        rig.proxy.set(common::db_proxy::Passage::Refused);
        tokio::time::sleep(Duration::from_secs(3)).await;
        rig.proxy.set(common::db_proxy::Passage::Open);
        tokio::time::sleep(Duration::from_secs(3)).await;
        stop.store(true, Ordering::SeqCst);
    };
    let (statuses, ()) = tokio::join!(futures::future::join_all(clients), outage);
    let statuses: Vec<(u16, Duration)> = statuses.into_iter().flatten().collect();
    let count = |status| statuses.iter().filter(|(s, _)| *s == status).count();
    assert_eq!(count(502), 0, "no call withheld");
    assert_eq!(count(200) + count(503), statuses.len(), "{statuses:?}");
    // Felt as a 503 (a reservation refused) or as a wait: a settle retried through the outage,
    // which is shorter than the ledger time-out, and then answered.
    let longest = statuses.iter().map(|(_, took)| *took).max().unwrap();
    eprintln!(
        "{} calls answered 200, {} answered 503, the longest took {longest:?}",
        count(200),
        count(503)
    );
    assert!(
        count(503) > 0 || longest > Duration::from_secs(2),
        "the outage was felt"
    );

    // A reservation whose commit landed while the connection was cut before its answer came
    // back was answered 503 and stays pending under the live lease (a gap the issue's note
    // names); the lease's clean end hands such entries to recovery, which refunds them.
    let stuck = rig.unfinished_after(0, Duration::from_secs(15)).await;
    let mut rig = rig;
    rig.upkeep.take().unwrap().stop().await;
    let orphans = model_gateway::recovery::recover_orphaned_reservations(rig.store.as_ref()).await;
    assert_eq!(orphans.unwrap().len() as i64, stuck);
    eprintln!("reservations committed with their answer lost: {stuck}");
    let leases = rig
        .db
        .store
        .connection()
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::Postgres,
            "SELECT COUNT(*) AS n FROM mg_instances",
        ))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        leases.try_get::<i64>("", "n").unwrap(),
        1,
        "the lease was kept, never taken anew"
    );
    let calls = rig.db.calls(&key).await;
    let billed = calls
        .iter()
        .filter(|call| call.status == CallStatus::Ok)
        .count();
    assert_eq!(billed, count(200), "each 200 billed once, no 503 billed");
    assert!(
        calls.iter().all(|call| !call
            .upstream_error
            .as_deref()
            .is_some_and(|error| error.contains("lease ended"))),
        "no call refunded for its lease"
    );
    rig.db.assert_audit_holds().await;
    rig.finish().await;
}

/// "The audit sees it": reservations not ended past the longest a call can take are reported,
/// with their credits, whether their entries are `pending` in the database or their holds are
/// in a store's memory (an owned `SQLite` file); ended ones never.
#[tokio::test]
async fn the_audit_reports_reservations_past_the_longest_call_in_the_database_and_in_memory() {
    async fn check(db: &TestDb) {
        let key = db.funded_key(100, 0).await;
        let caller = db.caller(&key).await;
        let charge = || {
            ChargeRequest::new(
                caller,
                model_gateway::Protocol::ChatCompletions,
                CHAT_MODEL,
                Credits::new(CHAT_PRICE),
            )
        };
        let held = db.store.reserve(charge()).await.unwrap();
        let ended = db.store.reserve(charge()).await.unwrap();
        let failure = CallFailure {
            upstream_status: None,
            error: "test".into(),
        };
        assert!(db.store.refund(ended.call, &failure).await.unwrap());
        let now = chrono::Utc::now();
        let later = now + chrono::Duration::seconds(60);
        let overdue = db.store.overdue_reservations(later).await.unwrap();
        assert_eq!(overdue.calls, 1, "the held one, not the ended one");
        assert_eq!(overdue.credits, i128::from(CHAT_PRICE));
        let earlier = now - chrono::Duration::seconds(60);
        assert_eq!(
            db.store.overdue_reservations(earlier).await.unwrap().calls,
            0
        );
        let audit = db.admin().audit().await.unwrap();
        assert_eq!(
            audit.overdue_reservations.calls, 0,
            "young reservations are no concern"
        );
        assert!(db.store.refund(held.call, &failure).await.unwrap());
        assert_eq!(db.store.overdue_reservations(later).await.unwrap().calls, 0);
    }
    each_database(async |db: &TestDb| check(db).await).await;
    #[cfg(feature = "sqlite")]
    check(&owned_sqlite_db().await).await;
    let memory = Arc::new(MemoryStore::new());
    let (_, key) = funded(&memory, 10).await;
    let caller = memory
        .caller_for_key(&model_gateway::keys::KeyHash::of(&key))
        .await
        .unwrap()
        .unwrap();
    let request = ChargeRequest::new(
        caller,
        model_gateway::Protocol::ChatCompletions,
        CHAT_MODEL,
        Credits::new(CHAT_PRICE),
    );
    memory.reserve(request).await.unwrap();
    let later = chrono::Utc::now() + chrono::Duration::seconds(60);
    assert_eq!(memory.overdue_reservations(later).await.unwrap().calls, 1);
}
