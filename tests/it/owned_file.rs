//! A `SQLite` file owned by one store (`SeaOrmStore::own_file`): reservations are held in
//! memory and each call is written once, when it ends. What other connections to the file do
//! meanwhile (grants, revocations, lapses, calls reserved in the database) is seen by the next
//! reservation, and no interleaving bills a call twice or takes an account below zero.

#![cfg(feature = "sqlite")]

use crate::common;

use std::sync::Arc;

use chrono::Utc;
use common::*;
use model_gateway::store::{Grant, IdempotencyKey};
use model_gateway::{
    Accounts, Credits, KeyStore, Ledger, Protocol, SeaOrmStore, credits::Bucket, keys::KeyHash,
    store::CallFailure, store::CallStatus, store::CallSuccess, store::Caller, store::ChargeRequest,
    store::ReserveError,
};

const PRICE: i64 = 3;

fn charge<'a>(caller: Caller, idempotency: Option<&'a IdempotencyKey>) -> ChargeRequest<'a> {
    ChargeRequest::new(
        caller,
        Protocol::ChatCompletions,
        CHAT_MODEL,
        Credits::new(PRICE),
    )
    .with_request_id(Some("req_owned"))
    .with_idempotency(idempotency)
}

async fn caller(db: &TestDb, key: &str) -> Caller {
    db.store
        .caller_for_key(&KeyHash::of(key))
        .await
        .unwrap()
        .unwrap()
}

/// The account's row as stored, read by a store that does not own the file (the CLI's view).
async fn stored_balance(other: &SeaOrmStore, account: model_gateway::AccountId) -> (i64, i64) {
    let row = other.account(account).await.unwrap().unwrap();
    (row.balance.subscription.get(), row.balance.topup.get())
}

fn success() -> CallSuccess {
    CallSuccess {
        upstream_status: 200,
        ..CallSuccess::default()
    }
}

#[tokio::test]
async fn a_held_call_is_written_once_when_it_ends_and_moves_the_row_only_if_billed() {
    let db = owned_sqlite_db().await;
    let other = SeaOrmStore::connect(&db.url).await.unwrap();
    let key = db.funded_key(10, 0).await;
    let caller = caller(&db, &key).await;

    let billed = db.store.reserve(charge(caller, None)).await.unwrap();
    let failed = db.store.reserve(charge(caller, None)).await.unwrap();
    assert_eq!(db.store.held_reservations().await, 2);
    assert!(db.calls(&key).await.is_empty(), "nothing written yet");
    assert_eq!(stored_balance(&other, caller.account).await, (10, 0));
    assert_eq!(db.balance(&key).await, balance(10 - 2 * PRICE, 0));
    assert_eq!(db.store.call_status(billed.call).await.unwrap(), None);

    assert!(db.store.settle(billed.call, success()).await.unwrap());
    let failure = CallFailure {
        upstream_status: Some(503),
        error: "down".into(),
    };
    assert!(db.store.refund(failed.call, &failure).await.unwrap());
    assert!(!db.store.refund(failed.call, &failure).await.unwrap());
    assert!(!db.store.settle(billed.call, success()).await.unwrap());

    assert_eq!(db.store.held_reservations().await, 0);
    assert_eq!(
        stored_balance(&other, caller.account).await,
        (10 - PRICE, 0)
    );
    assert_eq!(db.balance(&key).await, balance(10 - PRICE, 0));
    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), 2);
    let status = |call: model_gateway::CallId| calls.iter().find(|c| c.id == call).unwrap();
    assert_eq!(status(billed.call).status, CallStatus::Ok);
    assert_eq!(status(billed.call).upstream_status, Some(200));
    assert_eq!(status(failed.call).status, CallStatus::Refunded);
    assert_eq!(status(failed.call).upstream_error.as_deref(), Some("down"));
    assert!(
        calls
            .iter()
            .all(|c| c.request_id.as_deref() == Some("req_owned"))
    );
    db.assert_audit_holds().await;
}

/// The URL of a `SQLite` file in `dir`, and a store that owns it.
async fn owned_file_in(dir: &tempfile::TempDir) -> (String, SeaOrmStore) {
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("owned.db").display()
    );
    let owner = SeaOrmStore::connect(&url)
        .await
        .unwrap()
        .own_file()
        .unwrap();
    (url, owner)
}

#[tokio::test]
async fn a_second_owner_of_the_file_is_refused_until_the_first_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let (url, owner) = owned_file_in(&dir).await;
    let owner_clone = owner.clone();
    let second = SeaOrmStore::connect(&url).await.unwrap();
    let refused = second.clone().own_file().unwrap_err().to_string();
    assert!(refused.contains("another gateway owns"), "{refused}");
    // A store that does not own the file still works beside the owner.
    assert!(second.audit().await.is_ok());

    drop(owner);
    let still = second.clone().own_file().unwrap_err().to_string();
    assert!(
        still.contains("another gateway owns"),
        "a clone still owns it: {still}"
    );
    drop(owner_clone);
    assert!(second.own_file().is_ok());
}

#[tokio::test]
async fn grants_and_revocations_from_another_connection_apply_to_the_next_reservation() {
    let db = owned_sqlite_db().await;
    let cli = SeaOrmStore::connect(&db.url).await.unwrap();
    let key = db.funded_key(PRICE, 0).await;
    let caller = caller(&db, &key).await;
    let held = db.store.reserve(charge(caller, None)).await.unwrap();
    assert!(matches!(
        db.store.reserve(charge(caller, None)).await,
        Err(ReserveError::InsufficientCredits)
    ));

    cli.grant(caller.account, Bucket::Topup, Credits::new(PRICE))
        .await
        .unwrap();
    let second = db.store.reserve(charge(caller, None)).await.unwrap();
    assert_eq!(second.taken.topup, Credits::new(PRICE));

    assert!(cli.revoke_key(&KeyHash::of(&key)).await.unwrap());
    assert!(matches!(
        db.store.reserve(charge(caller, None)).await,
        Err(ReserveError::KeyRevoked)
    ));
    // Calls already under way end as they would have.
    assert!(db.store.settle(held.call, success()).await.unwrap());
    assert!(db.store.settle(second.call, success()).await.unwrap());
    assert_eq!(stored_balance(&cli, caller.account).await, (0, 0));
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn reservations_are_decided_without_a_batch_until_another_connection_writes() {
    let db = owned_sqlite_db().await;
    let cli = SeaOrmStore::connect(&db.url).await.unwrap();
    let key = db.funded_key(100, 0).await;
    let caller = caller(&db, &key).await;
    // The first reads the account and key in a batch; the next ones are decided from them.
    db.store.reserve(charge(caller, None)).await.unwrap();
    let batched = db.store.group_commit_stats().writes;
    for _ in 0..5 {
        db.store.reserve(charge(caller, None)).await.unwrap();
    }
    assert_eq!(db.store.group_commit_stats().writes, batched);
    assert_eq!(db.store.held_reservations().await, 6);

    // A write by anyone else sends the next reservation back to a batch, which reads afresh.
    cli.grant(caller.account, Bucket::Topup, Credits::new(1))
        .await
        .unwrap();
    db.store.reserve(charge(caller, None)).await.unwrap();
    assert_eq!(db.store.group_commit_stats().writes, batched + 1);
    assert!(cli.revoke_key(&KeyHash::of(&key)).await.unwrap());
    assert!(matches!(
        db.store.reserve(charge(caller, None)).await,
        Err(ReserveError::KeyRevoked)
    ));
    let left = db.store.balance(caller.account).await.unwrap();
    assert_eq!(left, balance(100 - 7 * PRICE, 1));
}

#[tokio::test]
async fn a_lapse_leaves_held_credits_for_their_calls_and_a_foreign_lapse_leaves_them_unbilled() {
    let db = owned_sqlite_db().await;
    let cli = SeaOrmStore::connect(&db.url).await.unwrap();
    let account = db.store.create_account("lapsing").await.unwrap();
    let now = Utc::now();
    let period = Grant {
        period_end: Some(now + chrono::Duration::seconds(60)),
        at: now,
        ..Grant::plain(Bucket::Subscription, Credits::new(10))
    };
    db.store.grant_once(account, period).await.unwrap();
    let key = model_gateway::keys::NewApiKey::generate();
    let key_id = db.store.add_key(account, &key).await.unwrap();
    let caller = Caller {
        account,
        key: key_id,
    };
    let first = db.store.reserve(charge(caller, None)).await.unwrap();
    let second = db.store.reserve(charge(caller, None)).await.unwrap();

    // The owner's own lapse (its upkeep) takes what is not held: 10 - 2 * 3.
    let ended = now + chrono::Duration::seconds(61);
    let lapses = db.store.lapse_ended_subscriptions(ended).await.unwrap();
    assert_eq!(lapses.len(), 1);
    assert_eq!(lapses[0].amount, Credits::new(10 - 2 * PRICE));
    assert!(db.store.settle(first.call, success()).await.unwrap());
    assert_eq!(stored_balance(&cli, account).await, (PRICE, 0));

    // Another process's lapse cannot see the holds: it takes the held credits too, and the
    // call they were held for ends unbilled, the account at zero, not below.
    let foreign = Grant {
        period_end: Some(ended + chrono::Duration::seconds(60)),
        at: ended,
        ..Grant::plain(Bucket::Subscription, Credits::new(1))
    };
    cli.grant_once(account, foreign).await.unwrap();
    assert_eq!(stored_balance(&cli, account).await, (1, 0));
    assert!(!db.store.settle(second.call, success()).await.unwrap());
    assert_eq!(
        db.store.call_status(second.call).await.unwrap(),
        Some(CallStatus::Refunded)
    );
    assert_eq!(stored_balance(&cli, account).await, (1, 0));
    db.assert_audit_holds().await;
}

/// Keyed calls are reserved in the database, by the pool, while unkeyed ones are held by the
/// committer: on one account with credits for only some of them, at once, each credit is spent
/// once and every 200 is billed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_and_keyed_calls_racing_for_one_account_spend_each_credit_once() {
    const CALLS: usize = 60;
    let db = owned_sqlite_db().await;
    let key = db.funded_key(20 * PRICE, 5 * PRICE).await;
    let caller = caller(&db, &key).await;
    let store: Arc<SeaOrmStore> = db.store.clone();
    let mut tasks = Vec::new();
    for n in 0..CALLS {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let idempotency = (n % 3 == 0).then(|| {
                IdempotencyKey::new(&format!("race-{n}"), "/v1/chat/completions", b"{}").unwrap()
            });
            let reserved = store.reserve(charge(caller, idempotency.as_ref())).await;
            match reserved {
                Ok(reservation) if n % 4 == 1 => {
                    let failure = CallFailure {
                        upstream_status: None,
                        error: "race".into(),
                    };
                    assert!(store.refund(reservation.call, &failure).await.unwrap());
                    0
                }
                Ok(reservation) => {
                    assert!(store.settle(reservation.call, success()).await.unwrap());
                    1
                }
                Err(ReserveError::InsufficientCredits) => 0,
                Err(error) => panic!("{error}"),
            }
        }));
    }
    let mut billed = 0;
    for task in tasks {
        billed += task.await.unwrap();
    }
    assert_eq!(db.store.held_reservations().await, 0);
    let calls = db.calls(&key).await;
    let ok = calls.iter().filter(|c| c.status == CallStatus::Ok).count();
    assert_eq!(ok, billed);
    assert!(calls.iter().all(|c| c.status != CallStatus::Pending));
    let left = db.balance(&key).await.total().get();
    assert_eq!(left, 25 * PRICE - PRICE * billed as i64);
    assert!(left >= 0);
    assert!(billed > 0);
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn held_calls_take_ids_that_entries_written_by_others_never_take() {
    let db = owned_sqlite_db().await;
    let key = db.funded_key(100, 0).await;
    let caller = caller(&db, &key).await;
    let held = db.store.reserve(charge(caller, None)).await.unwrap();
    // A keyed call is inserted by the pool, under the file's own id sequence.
    let idem = IdempotencyKey::new("ids", "/v1/chat/completions", b"{}").unwrap();
    let keyed = db.store.reserve(charge(caller, Some(&idem))).await.unwrap();
    assert_ne!(held.call, keyed.call);
    assert!(db.store.settle(keyed.call, success()).await.unwrap());
    assert!(db.store.settle(held.call, success()).await.unwrap());
    let mut ids: Vec<_> = db.calls(&key).await.iter().map(|c| c.id).collect();
    ids.sort();
    assert_eq!(ids.len(), 2);
    db.assert_audit_holds().await;
}

/// Held calls' settles in a batch that a failing statement rolls back: the batch is run again
/// one write at a time, so the others are billed once, the failing one is answered an error
/// and stays held until its refund ends it, and reservations are decided at once again
/// afterwards (the count of writes waiting for the committer, and the rows it last read,
/// survive the rollback). The failure is injected by another connection: a trigger refusing
/// the `ok` entry of one call. Which settles share a batch depends on when each reaches the
/// committer (another connection holds the write lock meanwhile, so most runs batch several);
/// the outcome must not.
#[tokio::test]
async fn a_rolled_back_batch_of_held_calls_bills_each_once_and_leaves_nothing_held() {
    use sea_orm::{ConnectionTrait, Database, TransactionTrait};

    let db = owned_sqlite_db().await;
    let other = Database::connect(&db.url).await.unwrap();
    other
        .execute_unprepared(
            "CREATE TRIGGER refuse_one_ok BEFORE INSERT ON mg_calls \
             WHEN NEW.status = 'ok' AND NEW.request_id = 'req_refused' \
             BEGIN SELECT RAISE(ABORT, 'injected failure'); END",
        )
        .await
        .unwrap();
    let key = db.funded_key(10 * PRICE, 0).await;
    let caller = caller(&db, &key).await;
    let mut held = Vec::new();
    for request_id in ["req_owned", "req_refused", "req_owned", "req_owned"] {
        let charge = charge(caller, None).with_request_id(Some(request_id));
        held.push(db.store.reserve(charge).await.unwrap().call);
    }
    let refused = held[1];

    let blocker = other.begin().await.unwrap();
    blocker
        .execute_unprepared("UPDATE mg_accounts SET name = 'renamed'")
        .await
        .unwrap();
    let before = db.store.group_commit_stats();
    let settles: Vec<_> = held
        .iter()
        .map(|&call| {
            let store = db.store.clone();
            tokio::spawn(async move { store.settle(call, success()).await })
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    blocker.commit().await.unwrap();
    let mut answers = Vec::new();
    for settle in settles {
        answers.push(settle.await.unwrap());
    }
    for (call, answer) in held.iter().zip(&answers) {
        if *call == refused {
            assert!(answer.is_err(), "the refused entry's settle fails");
        } else {
            assert!(matches!(answer, Ok(true)), "{answer:?}");
        }
    }
    let after = db.store.group_commit_stats();
    assert!(after.rolled_back > before.rolled_back);
    println!(
        "{} transactions rolled back for 4 settles in {} transactions",
        after.rolled_back - before.rolled_back,
        after.transactions - before.transactions
    );
    assert_eq!(db.store.held_reservations().await, 1, "the refused call");
    assert_eq!(db.balance(&key).await, balance(10 * PRICE - 4 * PRICE, 0));

    let failure = CallFailure {
        upstream_status: Some(200),
        error: "settle failed".into(),
    };
    assert!(db.store.refund(refused, &failure).await.unwrap());
    assert_eq!(db.store.held_reservations().await, 0);
    assert_eq!(db.balance(&key).await, balance(10 * PRICE - 3 * PRICE, 0));
    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), 4);
    for call in &calls {
        let expected = if call.id == refused {
            CallStatus::Refunded
        } else {
            CallStatus::Ok
        };
        assert_eq!(call.status, expected, "{call:?}");
    }
    db.assert_audit_holds().await;

    // Nothing waits for the committer any more: after one batch reads the rows again, the
    // next reservations are decided at once.
    db.store.reserve(charge(caller, None)).await.unwrap();
    let batched = db.store.group_commit_stats().writes;
    db.store.reserve(charge(caller, None)).await.unwrap();
    assert_eq!(db.store.group_commit_stats().writes, batched);
    assert_eq!(db.store.held_reservations().await, 2);
}

/// A reservation decided at once trusts the rows the committer last read only while it can
/// tell that nobody else has committed since. While the committer waits for the file's write
/// lock (another connection holds it and is revoking the key), it cannot tell: the reservation
/// goes to the committer instead of being decided from the rows it cached, and is refused once
/// the revocation has committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_goes_to_the_committer_while_nobody_can_tell_whether_a_revocation_committed()
{
    use sea_orm::{ConnectionTrait, Database, TransactionTrait};

    let db = owned_sqlite_db().await;
    let other = Database::connect(&db.url).await.unwrap();
    let key = db.funded_key(100, 0).await;
    let caller = caller(&db, &key).await;
    // Rows and key cached; the next reservation would be decided at once.
    let held = db.store.reserve(charge(caller, None)).await.unwrap();
    let cached = db.store.group_commit_stats().writes;
    db.store.reserve(charge(caller, None)).await.unwrap();
    assert_eq!(db.store.group_commit_stats().writes, cached);

    let revoking = other.begin().await.unwrap();
    revoking
        .execute_unprepared(&format!(
            "UPDATE mg_api_keys SET revoked_at = '2026-01-01T00:00:00+00:00' WHERE id = {}",
            caller.key.0
        ))
        .await
        .unwrap();
    // The settle's batch now waits for the write lock, with the committer's connection.
    let store = db.store.clone();
    let settle = tokio::spawn(async move { store.settle(held.call, success()).await });
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let store = db.store.clone();
    let reserve = tokio::spawn(async move { store.reserve(charge(caller, None)).await });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(
        !reserve.is_finished(),
        "decided from rows it could not vouch for"
    );
    assert!(!settle.is_finished());

    revoking.commit().await.unwrap();
    assert!(matches!(
        reserve.await.unwrap(),
        Err(ReserveError::KeyRevoked)
    ));
    assert!(settle.await.unwrap().unwrap());
    assert_eq!(db.store.held_reservations().await, 1);
    db.assert_audit_holds().await;
}

/// Takes the file's write lock through `other` and writes nothing: a batch started meanwhile
/// waits for the lock, and rolling back leaves the file's version as it was.
async fn write_lock(other: &sea_orm::DatabaseConnection) -> sea_orm::DatabaseTransaction {
    use sea_orm::{SqliteTransactionMode, TransactionOptions, TransactionTrait};

    other
        .begin_with_options(TransactionOptions {
            sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
            ..TransactionOptions::default()
        })
        .await
        .unwrap()
}

/// Long enough for a spawned call to reach the holds, the committer or the lock.
async fn pause() {
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
}

fn reserve_later(
    db: &TestDb,
    caller: Caller,
) -> tokio::task::JoinHandle<Result<model_gateway::store::Reservation, ReserveError>> {
    let store = db.store.clone();
    tokio::spawn(async move { store.reserve(charge(caller, None)).await })
}

fn settle_later(
    db: &TestDb,
    call: model_gateway::CallId,
) -> tokio::task::JoinHandle<Result<bool, model_gateway::store::StoreError>> {
    let store = db.store.clone();
    tokio::spawn(async move { store.settle(call, success()).await })
}

/// Drops a spawned call's future, as a client that goes away does.
async fn go_away<T: std::fmt::Debug>(task: tokio::task::JoinHandle<T>) {
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
}

/// Reservations that arrive while a batch is taking the file's write lock (here it waits for
/// another connection that holds the lock and writes nothing) wait, in order, instead of going
/// to a batch: once the batch has read the file's version under the lock, each is decided from
/// the cached rows, without a write of its own. A refund that arrives behind a waiting
/// reservation sends it on first, so that the credits it frees are not the reservation's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_arriving_while_a_batch_takes_the_lock_keep_their_place_without_a_write() {
    let db = owned_sqlite_db().await;
    let other = sea_orm::Database::connect(&db.url).await.unwrap();
    let tight_key = db.funded_key(PRICE, 0).await;
    let tight = caller(&db, &tight_key).await;
    let busy_key = db.funded_key(10 * PRICE, 0).await;
    let busy = caller(&db, &busy_key).await;
    let held = db.store.reserve(charge(tight, None)).await.unwrap();
    let mut settling = Vec::new();
    for _ in 0..2 {
        settling.push(db.store.reserve(charge(busy, None)).await.unwrap().call);
    }
    // Both accounts' rows are cached: a reservation is decided without a write.
    let before = db.store.group_commit_stats().writes;
    db.store.reserve(charge(busy, None)).await.unwrap();
    assert_eq!(db.store.group_commit_stats().writes, before);

    // 1. Two reservations wait for a settle's batch to take the lock; neither is written.
    let locking = write_lock(&other).await;
    let settle = settle_later(&db, settling[0]);
    pause().await;
    let refused = reserve_later(&db, tight);
    pause().await;
    let granted = reserve_later(&db, busy);
    pause().await;
    for task in [
        settle.is_finished(),
        refused.is_finished(),
        granted.is_finished(),
    ] {
        assert!(!task, "answered while the batch could not take the lock");
    }
    locking.rollback().await.unwrap();
    assert!(matches!(
        refused.await.unwrap(),
        Err(ReserveError::InsufficientCredits)
    ));
    granted.await.unwrap().unwrap();
    assert!(settle.await.unwrap().unwrap());
    assert_eq!(
        db.store.group_commit_stats().writes,
        before + 1,
        "the settle only"
    );

    // 2. A refund behind a waiting reservation: the reservation is decided first.
    let before = db.store.group_commit_stats().writes;
    let locking = write_lock(&other).await;
    let settle = settle_later(&db, settling[1]);
    pause().await;
    let refused = reserve_later(&db, tight);
    pause().await;
    let store = db.store.clone();
    let refund = tokio::spawn(async move {
        let failure = CallFailure {
            upstream_status: Some(502),
            error: "down".into(),
        };
        store.refund(held.call, &failure).await
    });
    pause().await;
    let granted = reserve_later(&db, tight);
    pause().await;
    for task in [
        settle.is_finished(),
        refused.is_finished(),
        refund.is_finished(),
    ] {
        assert!(!task, "answered while the batch could not take the lock");
    }
    assert!(!granted.is_finished());
    locking.rollback().await.unwrap();
    assert!(matches!(
        refused.await.unwrap(),
        Err(ReserveError::InsufficientCredits)
    ));
    assert!(refund.await.unwrap().unwrap());
    granted.await.unwrap().unwrap();
    assert!(settle.await.unwrap().unwrap());
    // Behind the refund, both reservations were sent to a batch.
    assert_eq!(db.store.group_commit_stats().writes, before + 4);

    assert_eq!(db.store.held_reservations().await, 3);
    db.assert_audit_holds().await;
}

/// A reservation waiting for a batch to take the write lock whose caller goes away (its future
/// dropped, as when a client disconnects) is dropped: it holds no credits once the batch has
/// the lock, where it would otherwise hold them until the gateway restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_reservation_whose_caller_went_away_holds_nothing() {
    let db = owned_sqlite_db().await;
    let other = sea_orm::Database::connect(&db.url).await.unwrap();
    let key = db.funded_key(10 * PRICE, 0).await;
    let caller = caller(&db, &key).await;
    let settling = db.store.reserve(charge(caller, None)).await.unwrap();
    db.store.reserve(charge(caller, None)).await.unwrap();
    assert_eq!(db.store.held_reservations().await, 2);

    let locking = write_lock(&other).await;
    let settle = settle_later(&db, settling.call);
    pause().await;
    let gone = reserve_later(&db, caller);
    pause().await;
    assert!(!gone.is_finished());
    go_away(gone).await;
    locking.rollback().await.unwrap();
    assert!(settle.await.unwrap().unwrap());

    // Only the second reservation is still held: its credits, and the settled call's.
    assert_eq!(db.store.held_reservations().await, 1);
    assert_eq!(db.balance(&key).await, balance(10 * PRICE - 2 * PRICE, 0));
    db.assert_audit_holds().await;
}

/// A reservation that goes to a batch (another connection has written since the rows were
/// cached) and whose caller goes away before the batch commits is held by it, answered to
/// nobody, and let go: no guard would ever end it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_lets_go_of_a_hold_whose_caller_went_away() {
    use sea_orm::ConnectionTrait;

    let db = owned_sqlite_db().await;
    let other = sea_orm::Database::connect(&db.url).await.unwrap();
    let key = db.funded_key(10 * PRICE, 0).await;
    let caller = caller(&db, &key).await;
    db.store.reserve(charge(caller, None)).await.unwrap();
    // The cached rows are stale from here: the next reservation goes to a batch.
    other
        .execute_unprepared("UPDATE mg_accounts SET name = 'renamed'")
        .await
        .unwrap();
    let locking = write_lock(&other).await;
    let written = db.store.group_commit_stats().writes;
    let gone = reserve_later(&db, caller);
    pause().await;
    assert!(!gone.is_finished(), "decided without waiting for the lock");
    go_away(gone).await;
    locking.rollback().await.unwrap();

    // The batch commits the hold (counted once it has), finds nobody to answer and lets it go.
    let started = std::time::Instant::now();
    let waited = |what: &str| {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10))
    };
    while db.store.group_commit_stats().writes == written {
        waited("the batch was not written").await;
    }
    while db.store.held_reservations().await != 1 {
        waited("the gone caller's hold was kept").await;
    }
    assert_eq!(db.balance(&key).await, balance(10 * PRICE - PRICE, 0));
    db.assert_audit_holds().await;
}

/// Many callers on one hot account at once, most reservations decided at once beside batches
/// of settles and refunds, while another connection grants credits and revokes the second of
/// the account's two keys: each credit is spent once, every `true` settle is one `ok` entry,
/// and no reservation that began after the revocation returned was granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_calls_beside_batches_and_another_connection_spend_each_credit_once() {
    use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

    const TASKS: usize = 16;
    const ROUNDS: usize = 40;
    const GRANTS: i64 = 20;
    let db = owned_sqlite_db().await;
    let cli = SeaOrmStore::connect(&db.url).await.unwrap();
    let key = db.funded_key(50 * PRICE, 0).await;
    let first = caller(&db, &key).await;
    let second_key = model_gateway::keys::NewApiKey::generate();
    let second = Caller {
        key: cli.add_key(first.account, &second_key).await.unwrap(),
        ..first
    };
    let revoked = Arc::new(AtomicBool::new(false));
    let billed = Arc::new(AtomicI64::new(0));
    let mut tasks = Vec::new();
    for n in 0..TASKS {
        let (store, revoked, billed) = (db.store.clone(), revoked.clone(), billed.clone());
        let caller = if n % 2 == 0 { first } else { second };
        tasks.push(tokio::spawn(async move {
            for round in 0..ROUNDS {
                let began_after_revocation = revoked.load(Ordering::SeqCst);
                match store.reserve(charge(caller, None)).await {
                    Ok(reservation) => {
                        assert!(
                            !(began_after_revocation && caller.key == second.key),
                            "a revoked key was granted a call"
                        );
                        if (n + round) % 3 == 0 {
                            let failure = CallFailure {
                                upstream_status: Some(502),
                                error: "race".into(),
                            };
                            assert!(store.refund(reservation.call, &failure).await.unwrap());
                        } else {
                            assert!(store.settle(reservation.call, success()).await.unwrap());
                            billed.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    Err(ReserveError::InsufficientCredits | ReserveError::KeyRevoked) => {
                        tokio::task::yield_now().await;
                    }
                    Err(error) => panic!("{error}"),
                }
            }
        }));
    }
    for grant in 0..GRANTS {
        tokio::time::sleep(std::time::Duration::from_millis(3)).await;
        cli.grant(first.account, Bucket::Topup, Credits::new(PRICE))
            .await
            .unwrap();
        if grant == GRANTS / 2 {
            assert!(cli.revoke_key(&second_key.hash()).await.unwrap());
            revoked.store(true, Ordering::SeqCst);
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let billed = billed.load(Ordering::SeqCst);
    assert_eq!(db.store.held_reservations().await, 0);
    let calls = db.calls(&key).await;
    let ok = calls.iter().filter(|c| c.status == CallStatus::Ok).count();
    assert_eq!(ok as i64, billed);
    assert!(calls.iter().all(|c| c.status != CallStatus::Pending));
    let stored = stored_balance(&cli, first.account).await;
    assert_eq!(stored.0 + stored.1, (50 + GRANTS) * PRICE - billed * PRICE);
    assert!(stored.0 >= 0 && stored.1 >= 0);
    assert!(billed > 0);
    println!(
        "{billed} billed of {} calls; {} writes in {} batches",
        TASKS * ROUNDS,
        db.store.group_commit_stats().writes,
        db.store.group_commit_stats().transactions
    );
    db.assert_audit_holds().await;
}

/// A small filesystem of its own, mounted for one test and unmounted after it.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    /// A tmpfs of `size` (e.g. `"4m"`); `None` where mounting is not allowed (not root).
    fn mount(size: &str) -> Option<SmallDisk> {
        let dir = tempfile::tempdir().unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .stderr(std::process::Stdio::null())
            .status();
        if !matches!(mounted, Ok(status) if status.success()) {
            eprintln!("a tmpfs cannot be mounted here (it needs root); skipping this test");
            return None;
        }
        Some(SmallDisk { dir })
    }

    /// Fills what is left with a ballast file.
    fn fill(&self) {
        use std::io::Write;
        let mut ballast = std::fs::File::create(self.dir.path().join("ballast")).unwrap();
        let chunk = vec![0_u8; 64 * 1024];
        while ballast.write_all(&chunk).is_ok() {}
        // The last bytes that fit, one at a time.
        while ballast.write_all(&[0]).is_ok() {}
    }

    fn free(&self) {
        std::fs::remove_file(self.dir.path().join("ballast")).unwrap();
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// Finding 1 of the fault run, on the owned file: with the disk full, calls' outcomes cannot be
/// written and their clients get 503; once space comes back, every held reservation ends on the
/// live gateway (no restart) and the held-aware balance equals the books.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_leaves_no_credit_held_once_space_comes_back() {
    let Some(disk) = SmallDisk::mount("8m") else {
        return;
    };
    let url = format!(
        "sqlite://{}?mode=rwc",
        disk.dir.path().join("gateway.db").display()
    );
    let store = Arc::new(
        SeaOrmStore::connect(&url)
            .await
            .unwrap()
            .own_file()
            .unwrap(),
    );
    let db = TestDb::at(store.clone(), url);
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(1000, 0).await;
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);

    let ready = async || {
        let answer = gateway.client.get(format!("{}/ready", gateway.base)).send();
        answer.await.unwrap().status().as_u16()
    };
    assert_eq!(ready().await, 200);
    disk.fill();
    assert_eq!(
        ready().await,
        503,
        "/ready says the ledger cannot take writes"
    );
    let mut refused = 0;
    for _ in 0..200 {
        match gateway.chat(&key, CHAT_MODEL).await.status {
            200 => {}
            503 => {
                refused += 1;
                break;
            }
            other => panic!("answered {other}"),
        }
    }
    assert_eq!(refused, 1, "the full disk made a call fail");
    let more = futures::future::join_all((0..7).map(|_| gateway.chat(&key, CHAT_MODEL))).await;
    assert!(more.iter().all(|answer| answer.status == 503), "{more:?}");
    // Most stay held while the disk is full (a rolled-back write may free room for a refund).
    eprintln!(
        "held while the disk is full: {}",
        store.held_reservations().await
    );

    disk.free();
    for _ in 0..150 {
        if store.held_reservations().await == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(
        store.held_reservations().await,
        0,
        "nothing held by nothing"
    );
    let calls = db.calls(&key).await;
    let billed = calls
        .iter()
        .filter(|call| call.status == CallStatus::Ok)
        .count() as i64;
    let refunded = calls
        .iter()
        .filter(|call| call.status == CallStatus::Refunded)
        .count();
    assert!(refunded >= 1, "the refused calls were refunded: {refunded}");
    assert_eq!(
        db.balance(&key).await.total().get(),
        1000 - billed * CHAT_PRICE,
        "the held-aware balance equals the books"
    );
    db.assert_audit_holds().await;
    assert_eq!(
        gateway.chat(&key, CHAT_MODEL).await.status,
        200,
        "serving again"
    );
}

/// A keyed call whose key has no record is held like any other (no entry while it runs), and
/// the batch that ends it writes its record: with the reply to keep if it was billed. The
/// records stand in the file: a new owner of it replays the billed call's reply, uncharged,
/// and refuses the key for another request.
#[tokio::test]
async fn a_held_keyed_call_gets_its_record_when_billed_and_keeps_it_across_owners() {
    use model_gateway::store::KeptReply;
    let dir = tempfile::tempdir().unwrap();
    let (url, owner) = owned_file_in(&dir).await;
    let db = TestDb::at(Arc::new(owner), url.clone());
    let key = db.funded_key(10 * PRICE, 0).await;
    let caller = caller(&db, &key).await;
    let idem =
        |name: &str, body: &[u8]| IdempotencyKey::new(name, "/v1/chat/completions", body).unwrap();
    // The first keyed call reads which keys have records: it is reserved in the file.
    let first = idem("first", b"{}");
    let reserved = db
        .store
        .reserve(charge(caller, Some(&first)))
        .await
        .unwrap();
    assert_eq!(db.calls(&key).await.len(), 1, "reserved in the file");
    assert!(db.store.settle(reserved.call, success()).await.unwrap());

    let billed = idem("billed", b"{\"a\":1}");
    let reserved = db
        .store
        .reserve(charge(caller, Some(&billed)))
        .await
        .unwrap();
    assert_eq!(db.calls(&key).await.len(), 1, "held: no entry yet");
    assert!(matches!(
        db.store.reserve(charge(caller, Some(&billed))).await,
        Err(ReserveError::IdempotentCallRunning)
    ));
    let reply = KeptReply::new(200, Some("application/json".into()), "{\"kept\":1}".into());
    let settled = CallSuccess {
        reply: reply.clone(),
        ..success()
    };
    assert!(db.store.settle(reserved.call, settled).await.unwrap());
    let refunded = idem("refunded", b"{}");
    let reserved = db
        .store
        .reserve(charge(caller, Some(&refunded)))
        .await
        .unwrap();
    let failure = CallFailure {
        upstream_status: Some(500),
        error: "down".into(),
    };
    assert!(db.store.refund(reserved.call, &failure).await.unwrap());
    let records = |db: &TestDb| {
        let connection = db.store.connection().clone();
        async move {
            use sea_orm::ConnectionTrait;
            let rows = connection
                .query_all_raw(sea_orm::Statement::from_string(
                    connection.get_database_backend(),
                    "SELECT idem_key, reply_body FROM mg_idempotent_calls ORDER BY id",
                ))
                .await
                .unwrap();
            rows.iter()
                .map(|row| {
                    let key: String = row.try_get_by_index(0).unwrap();
                    let body: Option<Vec<u8>> = row.try_get_by_index(1).unwrap();
                    (key, body.map(|b| String::from_utf8(b).unwrap()))
                })
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        records(&db).await,
        [
            ("first".to_owned(), None),
            ("billed".to_owned(), Some("{\"kept\":1}".to_owned())),
            ("refunded".to_owned(), None),
        ]
    );
    let statuses: Vec<_> = db.calls(&key).await.iter().map(|c| c.status).collect();
    assert_eq!(statuses.len(), 3);
    assert_eq!(db.balance(&key).await.total().get(), 8 * PRICE);

    // The refunded call's key refuses another request, and is free for the same one.
    assert!(matches!(
        db.store
            .reserve(charge(caller, Some(&idem("refunded", b"{\"b\":1}"))))
            .await,
        Err(ReserveError::IdempotencyKeyReused)
    ));
    let again = db
        .store
        .reserve(charge(caller, Some(&refunded)))
        .await
        .unwrap();
    assert!(db.store.settle(again.call, success()).await.unwrap());
    assert_eq!(db.balance(&key).await.total().get(), 7 * PRICE);

    // A new owner of the file, with the records only the file knows.
    let store = db.store.clone();
    drop(db);
    drop(store);
    let (url, owner) = owned_file_in(&dir).await;
    let db = TestDb::at(Arc::new(owner), url);
    let replayed = db.store.reserve(charge(caller, Some(&billed))).await;
    match replayed {
        Err(ReserveError::AlreadyAnswered(Some(kept))) => {
            assert_eq!(Some(kept), reply);
        }
        other => panic!("not replayed: {other:?}"),
    }
    assert!(matches!(
        db.store
            .reserve(charge(caller, Some(&idem("billed", b"{\"a\":2}"))))
            .await,
        Err(ReserveError::IdempotencyKeyReused)
    ));
    assert_eq!(db.balance(&key).await.total().get(), 7 * PRICE);
    db.assert_audit_holds().await;
}

/// Keyed calls on a few idempotency keys, plain calls and refunds, all at once on an owned
/// file, first alone and then with grants from another connection (which send reservations to
/// the committer): a key's calls are held at once, queued behind a batch, or reserved in the
/// database once the key has a record, and through all of it each key is billed at most once,
/// and the balance is what was granted less what was billed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keyed_plain_refunded_and_granted_at_once_bill_each_key_at_most_once() {
    let db = owned_sqlite_db().await;
    let key = db.funded_key(0, 200 * PRICE).await;
    let caller = caller(&db, &key).await;
    // The first keyed call reads which keys have records.
    let first = IdempotencyKey::new("first", "/v1/chat/completions", b"{}").unwrap();
    let reserved = db
        .store
        .reserve(charge(caller, Some(&first)))
        .await
        .unwrap();
    assert!(db.store.settle(reserved.call, success()).await.unwrap());
    let mut billed = 1;
    let mut granted = 0;
    for round in ["alone", "granting"] {
        let (n, g) = keyed_race(&db, caller, round, round == "granting").await;
        billed += n;
        granted += g;
    }
    assert_eq!(db.store.held_reservations().await, 0);
    let calls = db.calls(&key).await;
    assert!(calls.iter().all(|c| c.status != CallStatus::Pending));
    let ok = calls.iter().filter(|c| c.status == CallStatus::Ok).count();
    assert_eq!(ok as i64, billed);
    let left = db.balance(&key).await.total().get();
    assert_eq!(left, 200 * PRICE + granted - PRICE * billed);
    db.assert_audit_holds().await;
}

/// One round of [`keyed_plain_refunded_and_granted_at_once_bill_each_key_at_most_once`], its
/// keys named after `round`; returns the calls billed and the credits granted.
async fn keyed_race(db: &TestDb, caller: Caller, round: &str, granting: bool) -> (i64, i64) {
    const CALLS: usize = 150;
    const KEYS: usize = 7;
    const GRANTS: i64 = 30;
    let other = SeaOrmStore::connect(&db.url).await.unwrap();
    let account = caller.account;
    let grants = tokio::spawn(async move {
        if !granting {
            return 0;
        }
        for _ in 0..GRANTS {
            other
                .grant(account, Bucket::Topup, Credits::new(1))
                .await
                .unwrap();
            tokio::task::yield_now().await;
        }
        GRANTS
    });
    let mut tasks = Vec::new();
    for n in 0..CALLS {
        let store = db.store.clone();
        let keyed = (n % 4 != 0).then(|| {
            let name = format!("{round}-{}", n % KEYS);
            IdempotencyKey::new(&name, "/v1/chat/completions", b"{}").unwrap()
        });
        tasks.push(tokio::spawn(async move {
            let reserved = store.reserve(charge(caller, keyed.as_ref())).await;
            let label = keyed.as_ref().map(|k| k.key().to_owned());
            match reserved {
                Ok(reservation) => {
                    // The upstream's time: the call stays held while others arrive.
                    tokio::time::sleep(std::time::Duration::from_millis(2)).await;
                    if n % 5 == 1 {
                        let failure = CallFailure {
                            upstream_status: Some(500),
                            error: "race".into(),
                        };
                        assert!(store.refund(reservation.call, &failure).await.unwrap());
                        (label, 0)
                    } else {
                        assert!(store.settle(reservation.call, success()).await.unwrap());
                        (label, 1)
                    }
                }
                Err(
                    ReserveError::IdempotentCallRunning
                    | ReserveError::AlreadyAnswered(_)
                    | ReserveError::InsufficientCredits,
                ) => (label, 0),
                Err(error) => panic!("{error}"),
            }
        }));
    }
    let mut billed_per_key = std::collections::HashMap::new();
    let mut billed = 0;
    for task in tasks {
        let (label, n) = task.await.unwrap();
        billed += n;
        if let Some(label) = label {
            *billed_per_key.entry(label).or_insert(0) += n;
        }
    }
    for (label, n) in &billed_per_key {
        assert!(*n <= 1, "{round}: key {label} billed {n} times");
    }
    assert!(
        billed_per_key.values().sum::<i64>() > 0,
        "{round}: none billed"
    );
    (billed, grants.await.unwrap())
}

/// What a plain call's reservation moves to the heap (`async_trait` boxes the store's future on
/// every call) stays small: the keyed and escrow paths' larger futures are boxed apart. Inline,
/// they made it about 16 KB, copied on every call. The keyed call's is still whole.
#[tokio::test]
async fn a_plain_reservation_moves_a_small_future_to_the_heap() {
    let db = owned_sqlite_db().await;
    let key = db.funded_key(10, 0).await;
    let caller = caller(&db, &key).await;
    let plain = db.store.reserve(charge(caller, None));
    let size = std::mem::size_of_val(&*plain);
    eprintln!("a plain reservation's future: {size} bytes");
    assert!(size <= 2048, "a plain reservation's future is {size} bytes");
    let reservation = plain.await.unwrap();
    assert!(db.store.settle(reservation.call, success()).await.unwrap());

    let idempotency = IdempotencyKey::new("k-1", "/v1/chat/completions", b"{}").unwrap();
    let keyed = db.store.reserve(charge(caller, Some(&idempotency)));
    let reservation = keyed.await.unwrap();
    assert!(db.store.settle(reservation.call, success()).await.unwrap());
    assert_eq!(
        db.store
            .balance(caller.account)
            .await
            .unwrap()
            .subscription
            .get(),
        10 - 2 * PRICE
    );
    db.assert_audit_holds().await;
}
