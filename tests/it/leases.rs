//! Instance leases on `SQLite`, `PostgreSQL` and `MariaDB`, with the time set by the test: a dead
//! instance's reservations are refunded at once, however young; a live one's never, however
//! old; an ended lease is never revived; two instances recovering together refund each
//! reservation once.

use crate::common;

use std::time::Duration;

use chrono::{DateTime, Utc};
use common::*;
use model_gateway::{
    Accounts, Credits, KeyStore, Ledger, Protocol, keys::KeyHash,
    recovery::recover_orphaned_reservations, recovery::recover_stale_reservations,
    store::CallStatus, store::Caller, store::ChargeRequest, store::Leases, store::Reservation,
};

const TTL: Duration = Duration::from_secs(10);

fn after(now: DateTime<Utc>, seconds: i64) -> DateTime<Utc> {
    now + chrono::Duration::seconds(seconds)
}

async fn caller(db: &TestDb, credits: i64) -> (String, Caller) {
    let key = db.funded_key(credits, 0).await;
    let caller = db
        .store
        .caller_for_key(&KeyHash::of(&key))
        .await
        .unwrap()
        .unwrap();
    (key, caller)
}

async fn reserve(store: &dyn Ledger, caller: Caller) -> Reservation {
    store.reserve(charge(caller)).await.unwrap()
}

/// Settles the call; whether this settle ended it.
async fn settle(db: &TestDb, reservation: &Reservation) -> bool {
    db.store
        .settle(reservation.call, Default::default())
        .await
        .unwrap()
}

async fn status(db: &TestDb, reservation: &Reservation) -> CallStatus {
    db.store
        .call_status(reservation.call)
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn a_dead_instances_reservations_are_orphaned_at_its_expiry_and_a_live_ones_never() {
    each_database(async |db| {
        let peer = db.second_instance().await;
        let now = Utc::now();
        db.store.take_lease(now, TTL).await.unwrap().unwrap();
        peer.store.take_lease(now, TTL).await.unwrap().unwrap();
        let (key, caller) = caller(db, 100).await;
        let dead = reserve(db.store.as_ref(), caller).await;
        let live = reserve(peer.store.as_ref(), caller).await;

        assert!(
            peer.store
                .orphaned_reservations(after(now, 5), 100)
                .await
                .unwrap()
                .is_empty(),
            "both leases hold"
        );
        // The peer renews; the first instance does not (it died).
        assert!(peer.store.renew_lease(after(now, 8), TTL).await.unwrap());
        let orphaned = peer
            .store
            .orphaned_reservations(after(now, 11), 100)
            .await
            .unwrap();
        assert_eq!(orphaned, vec![dead.call]);

        // Recovery at the real time refunds nothing yet: the dead lease has not expired.
        assert!(
            recover_orphaned_reservations(peer.store.as_ref())
                .await
                .unwrap()
                .is_empty()
        );
        assert_eq!(status(db, &dead).await, CallStatus::Pending);
        // Ending it (as a clean stop does) makes its reservations recoverable at once.
        db.store.release_lease().await.unwrap();
        let refunded = recover_orphaned_reservations(peer.store.as_ref())
            .await
            .unwrap();
        assert_eq!(refunded, vec![dead.call]);
        assert_eq!(status(db, &dead).await, CallStatus::Refunded);
        assert_eq!(status(db, &live).await, CallStatus::Pending);
        assert_eq!(db.balance(&key).await, balance(100 - CHAT_PRICE, 0));
        db.assert_audit_holds().await;
    })
    .await;
}

#[tokio::test]
async fn the_age_rule_never_takes_a_live_instances_reservation_however_old() {
    each_database(async |db| {
        let (key, caller) = caller(db, 100).await;
        let unleased = reserve(db.store.as_ref(), caller).await;
        db.store.take_lease(Utc::now(), TTL).await.unwrap();
        let leased = reserve(db.store.as_ref(), caller).await;
        tokio::time::sleep(Duration::from_millis(20)).await;

        // An age of zero: everything is old enough, but a live lease protects its own.
        let refunded = recover_stale_reservations(db.store.as_ref(), Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(
            refunded,
            vec![unleased.call],
            "only the reservation under no lease"
        );
        assert_eq!(status(db, &leased).await, CallStatus::Pending);
        assert!(settle(db, &leased).await);
        assert_eq!(db.balance(&key).await, balance(100 - CHAT_PRICE, 0));
        db.assert_audit_holds().await;
    })
    .await;
}

#[tokio::test]
async fn an_ended_lease_is_never_revived_and_its_holder_takes_a_new_one() {
    each_database(async |db| {
        let peer = db.second_instance().await;
        let now = Utc::now();
        let first = db.store.take_lease(now, TTL).await.unwrap().unwrap();
        let (key, caller) = caller(db, 100).await;
        let under_the_old_lease = reserve(db.store.as_ref(), caller).await;

        // Unreachable for longer than the lease: the renewal comes too late.
        assert!(!db.store.renew_lease(after(now, 11), TTL).await.unwrap());
        assert!(
            !db.store.renew_lease(after(now, 12), TTL).await.unwrap(),
            "a lost lease stays lost"
        );
        // Meanwhile a peer recovered the call (here: as soon as the lease ended).
        let orphaned = peer
            .store
            .orphaned_reservations(after(now, 11), 100)
            .await
            .unwrap();
        assert_eq!(orphaned, vec![under_the_old_lease.call]);
        for call in orphaned {
            let failure = model_gateway::store::CallFailure {
                upstream_status: None,
                error: "recovered".into(),
            };
            assert!(peer.store.refund(call, &failure).await.unwrap());
        }
        // The call under way ends: its settle finds it refunded and bills nothing.
        assert!(!settle(db, &under_the_old_lease).await);
        assert_eq!(status(db, &under_the_old_lease).await, CallStatus::Refunded);

        let second = db.store.take_lease(Utc::now(), TTL).await.unwrap().unwrap();
        assert_ne!(first, second);
        let under_the_new_lease = reserve(db.store.as_ref(), caller).await;
        assert!(
            recover_orphaned_reservations(peer.store.as_ref())
                .await
                .unwrap()
                .is_empty(),
            "the new lease holds"
        );
        assert!(settle(db, &under_the_new_lease).await);
        assert_eq!(db.balance(&key).await, balance(100 - CHAT_PRICE, 0));
        db.assert_audit_holds().await;
    })
    .await;
}

/// A gateway unreachable for longer than its lease, then back: its own recovery never
/// refunds the calls it is still serving under the lease it lost (the adversarial run: its 6
/// streams in flight refunded by its own recovery, then finished, complete and unbilled). They
/// are billed when they end. Another instance may still recover them, as before.
#[tokio::test]
async fn a_gateway_back_from_an_outage_longer_than_its_lease_keeps_its_own_calls() {
    each_database(async |db| {
        let peer = db.second_instance().await;
        let now = Utc::now();
        db.store.take_lease(now, TTL).await.unwrap().unwrap();
        let (key, caller) = caller(db, 100).await;
        let serving = reserve(db.store.as_ref(), caller).await;
        let recovered_by_a_peer = reserve(db.store.as_ref(), caller).await;
        // The database was out of reach past the lease: the renewal finds it ended.
        assert!(!db.store.renew_lease(after(now, 11), TTL).await.unwrap());
        db.store.take_lease(Utc::now(), TTL).await.unwrap().unwrap();

        // Its own recovery, as its upkeep runs it when the database is back: nothing.
        let own = db
            .store
            .orphaned_reservations(after(now, 11), 100)
            .await
            .unwrap();
        assert!(
            own.is_empty(),
            "its own calls under way were taken: {own:?}"
        );
        assert!(
            recover_orphaned_reservations(db.store.as_ref())
                .await
                .unwrap()
                .is_empty()
        );
        assert_eq!(status(db, &serving).await, CallStatus::Pending);

        // The call it still serves ends: billed.
        assert!(settle(db, &serving).await);
        // Another instance's recovery still finds what the lost lease left.
        let orphaned = peer
            .store
            .orphaned_reservations(after(now, 11), 100)
            .await
            .unwrap();
        assert_eq!(orphaned, vec![recovered_by_a_peer.call]);
        assert_eq!(db.balance(&key).await.total().get(), 100 - 2 * CHAT_PRICE);
        db.assert_audit_holds().await;
    })
    .await;
}

#[tokio::test]
async fn two_instances_recovering_at_once_refund_each_reservation_once() {
    const CALLS: usize = 60;
    each_database(async |db| {
        let (first, second) = (db.second_instance().await, db.second_instance().await);
        db.store.take_lease(Utc::now(), TTL).await.unwrap();
        let (key, caller) = caller(db, 1000).await;
        for _ in 0..CALLS {
            reserve(db.store.as_ref(), caller).await;
        }
        db.store.release_lease().await.unwrap();

        let (a, b) = tokio::join!(
            recover_orphaned_reservations(first.store.as_ref()),
            recover_orphaned_reservations(second.store.as_ref()),
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.len() + b.len(), CALLS, "{} + {}", a.len(), b.len());
        assert!(
            a.iter().all(|call| !b.contains(call)),
            "a call refunded twice"
        );
        assert_eq!(db.balance(&key).await, balance(1000, 0));
        db.assert_audit_holds().await;
        assert_eq!(
            db.store.forget_ended_leases(Utc::now()).await.unwrap(),
            1,
            "the ended lease, with nothing pending, is forgotten"
        );
    })
    .await;
}

#[tokio::test]
async fn an_ended_lease_with_calls_pending_is_kept_until_they_are_recovered() {
    each_database(async |db| {
        db.store.take_lease(Utc::now(), TTL).await.unwrap();
        let (_, caller) = caller(db, 100).await;
        reserve(db.store.as_ref(), caller).await;
        db.store.release_lease().await.unwrap();
        assert_eq!(db.store.forget_ended_leases(Utc::now()).await.unwrap(), 0);
        assert_eq!(
            recover_orphaned_reservations(db.store.as_ref())
                .await
                .unwrap()
                .len(),
            1
        );
        assert_eq!(db.store.forget_ended_leases(Utc::now()).await.unwrap(), 1);
        db.assert_audit_holds().await;
    })
    .await;
}

#[cfg(feature = "sqlite")]
/// On a `SQLite` file the lock file tells at once that a lease's holder is gone: a store dropped
/// without ending its lease (as a killed process leaves it) is found dead long before expiry.
#[tokio::test]
async fn on_a_sqlite_file_a_gone_holders_lease_ends_before_its_expiry() {
    let db = sqlite_db().await;
    let (key, caller) = caller(&db, 100).await;
    let crashed = db.second_instance().await;
    crashed
        .store
        .take_lease(Utc::now(), Duration::from_secs(3600))
        .await
        .unwrap();
    let lost = reserve(crashed.store.as_ref(), caller).await;
    let alive = db.second_instance().await;
    alive
        .store
        .take_lease(Utc::now(), Duration::from_secs(3600))
        .await
        .unwrap();
    let kept = reserve(alive.store.as_ref(), caller).await;
    assert!(
        recover_orphaned_reservations(db.store.as_ref())
            .await
            .unwrap()
            .is_empty(),
        "both holders are alive"
    );

    drop(crashed);
    let refunded = recover_orphaned_reservations(db.store.as_ref())
        .await
        .unwrap();
    assert_eq!(refunded, vec![lost.call]);
    assert_eq!(status(&db, &kept).await, CallStatus::Pending);
    assert_eq!(db.balance(&key).await, balance(100 - CHAT_PRICE, 0));
    db.assert_audit_holds().await;
}

/// A gateway that finds its lease ended (as after the database was out of reach for longer than
/// the lease) takes a new one at its next heartbeat, so that its later calls are protected
/// again; and a clean stop ends the lease, leaving nothing for recovery to guess.
#[tokio::test]
async fn upkeep_takes_a_new_lease_when_its_lease_was_lost_and_ends_it_on_stop() {
    let db = local_db().await;
    let (_, caller) = caller(&db, 100).await;
    let upkeep = model_gateway::recovery::Upkeep::new(db.store.clone(), Duration::from_secs(3600))
        .lease_ttl(Duration::from_secs(1));
    let heartbeat = upkeep.heartbeat();
    let upkeep = upkeep.start().await.unwrap();
    db.store.release_lease().await.unwrap(); // lost, as far as the store can tell
    let unprotected = reserve(db.store.as_ref(), caller).await;
    tokio::time::sleep(heartbeat * 3).await;
    let protected = reserve(db.store.as_ref(), caller).await;

    let refunded = recover_stale_reservations(db.store.as_ref(), Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(
        refunded,
        vec![unprotected.call],
        "the call made under the new lease is protected"
    );
    assert_eq!(status(&db, &protected).await, CallStatus::Pending);

    upkeep.stop().await;
    let refunded = recover_orphaned_reservations(db.store.as_ref())
        .await
        .unwrap();
    assert_eq!(refunded, vec![protected.call]);
    db.assert_audit_holds().await;
}

/// Finding 3 of the fault run: a gateway stops reserving under its lease once it could not
/// renew it in time (its time to live less a heartbeat, a fifth of it), before any other
/// instance could judge it ended and refund what is reserved under it; a renewal opens it
/// again.
#[tokio::test]
async fn no_call_is_reserved_under_a_lease_not_renewed_in_time() {
    each_database(async |db: &TestDb| {
        let (_, caller) = caller(db, 100).await;
        let ttl = Duration::from_millis(1000);
        db.store.take_lease(Utc::now(), ttl).await.unwrap();
        let reserved = reserve(db.store.as_ref(), caller).await;
        assert!(db.store.refund(reserved.call, &failure()).await.unwrap());

        tokio::time::sleep(Duration::from_millis(850)).await;
        let refused = db.store.reserve(charge(caller)).await;
        assert!(
            matches!(refused, Err(model_gateway::store::ReserveError::Store(_))),
            "{refused:?}"
        );
        // `/ready` says so too: on a database server, the lease's renewals are the writes it sees.
        let not_ready = db.store.ready().await.unwrap_err();
        assert!(not_ready.to_string().contains("lease"), "{not_ready}");

        assert!(db.store.renew_lease(Utc::now(), ttl).await.unwrap());
        db.store.ready().await.unwrap();
        let reserved = reserve(db.store.as_ref(), caller).await;
        assert_eq!(status(db, &reserved).await, CallStatus::Pending);
        db.store.release_lease().await.unwrap();
    })
    .await;
}

fn charge(caller: Caller) -> ChargeRequest<'static> {
    ChargeRequest::new(
        caller,
        Protocol::ChatCompletions,
        CHAT_MODEL,
        Credits::new(CHAT_PRICE),
    )
}

fn failure() -> model_gateway::store::CallFailure {
    model_gateway::store::CallFailure {
        upstream_status: None,
        error: "test".into(),
    }
}
