//! Recovery of reservations that no call will ever finish: the gateway process was killed, or
//! the database was unreachable when the call tried to settle or refund.
//!
//! Two rules find them, and every refund goes through [`Ledger::refund`], whose status guard
//! makes recovery safe on several instances at once: a reservation is refunded by exactly one.
//!
//! - **Leases** (the first rule): a serving gateway holds an instance lease that it renews every
//!   heartbeat, and each reservation records it ([`Leases`]). Once a lease ends (its holder
//!   stopped renewing, or, on a `SQLite` file, its process is gone), its reservations are
//!   refunded at once by [`recover_orphaned_reservations`], however young. A live instance's
//!   reservations are never touched, however old: a long stream is alive.
//! - **Age** (the backstop): every call is bounded
//!   ([`RefundOnUpstreamErrorLayer::upstream_bound`]), so a reservation made under no lease and
//!   still `pending` well after that bound belongs to no live call. [`recover_stale_reservations`]
//!   refunds those.
//!
//! [`Upkeep`] runs both for a serving gateway, with the subscription periods' lapses and the
//! forgetting of idempotency keys past their window.
//!
//! **A gateway that lost its lease** (it could not renew it for longer than its time to live,
//! say the database was unreachable) takes a new one as soon as it can, and logs an error. Its
//! calls under way were reserved under the old lease. It keeps them: its own recovery never
//! refunds a call under a lease it lost while it lived (on the sea-orm store), so they are
//! billed or refunded as they end, once the database is back. Another instance's recovery may
//! have taken them meanwhile, which it cannot tell from a crash: a call whose reservation was
//! refunded is not billed when it ends (the settle's status guard finds it refunded), so the
//! client is answered `502` and charged nothing, or, for a stream already delivered, got it
//! free. The two sides agree on time through the lease's expiry, written with the holder's clock
//! and read with the reader's (hosts kept in step, as NTP does; a margin covers the rest). Nothing
//! is ever billed twice or refunded twice.
//!
//! [`RefundOnUpstreamErrorLayer::upstream_bound`]: crate::RefundOnUpstreamErrorLayer::upstream_bound

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;

use crate::catalogue::Catalogue;
use crate::store::{CallFailure, CallId, Leases, Ledger, Store, StoreError};

/// How long an instance lease holds without renewal, by default: how soon after a gateway dies
/// its reservations are refunded (on a `SQLite` file, a restarted gateway does not wait for it).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

/// How often the age rule and the subscription lapses run.
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(60);

/// How many stale reservations one pass looks at.
const BATCH: u64 = 500;

/// Refunds every reservation still `pending` that was made more than `older_than` ago. Returns
/// the calls this pass refunded (not those another instance refunded first).
pub async fn recover_stale_reservations(
    ledger: &dyn Ledger,
    older_than: Duration,
) -> Result<Vec<CallId>, StoreError> {
    let age = chrono::Duration::from_std(older_than)
        .map_err(|_| StoreError::Invalid("recovery age out of range".into()))?;
    let cutoff = Utc::now() - age;
    let failure = CallFailure {
        upstream_status: None,
        error: format!(
            "recovered: still pending {}s after it was reserved (the gateway stopped mid-call or \
             could not reach the database)",
            older_than.as_secs()
        ),
    };
    let mut refunded = Vec::new();
    loop {
        let stale = ledger.stale_reservations(cutoff, BATCH).await?;
        let batch_len = stale.len() as u64;
        for call in stale {
            if ledger.refund(call, &failure).await? {
                refunded.push(call);
            }
        }
        if batch_len < BATCH {
            return Ok(refunded);
        }
    }
}

/// Refunds every reservation still `pending` whose instance lease no longer holds (see
/// [`Leases::orphaned_reservations`]). Returns the calls this pass refunded.
pub async fn recover_orphaned_reservations<S>(store: &S) -> Result<Vec<CallId>, StoreError>
where
    S: Ledger + Leases + ?Sized,
{
    let failure = CallFailure {
        upstream_status: None,
        error: "recovered: the gateway instance serving it stopped (its lease ended)".to_owned(),
    };
    let mut refunded = Vec::new();
    loop {
        let orphaned = store.orphaned_reservations(Utc::now(), BATCH).await?;
        let batch_len = orphaned.len() as u64;
        let mut moved = false;
        for call in orphaned {
            if store.refund(call, &failure).await? {
                refunded.push(call);
                moved = true;
            }
        }
        // A full batch that another instance refunded first would come back the same: stop.
        if batch_len < BATCH || !moved {
            return Ok(refunded);
        }
    }
}

/// What a serving gateway does beside its calls: holds its instance lease, refunds what dead
/// instances left, lapses ended subscription periods, and applies the age rule. See the module
/// docs.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use model_gateway::recovery::Upkeep;
/// use model_gateway::SeaOrmStore;
///
/// # #[cfg(feature = "sqlite")]
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let store = Arc::new(SeaOrmStore::connect("sqlite::memory:").await.unwrap());
/// // Takes the lease and recovers what a crashed predecessor left before it returns.
/// let upkeep = Upkeep::new(store, Duration::from_secs(450)).start().await.unwrap();
/// // ... serve ...
/// upkeep.stop().await; // a clean stop ends the lease
/// # }
/// # #[cfg(not(feature = "sqlite"))] fn main() {}
/// ```
#[derive(Debug)]
#[must_use]
pub struct Upkeep<S> {
    store: Arc<S>,
    recovery_age: Duration,
    lease_ttl: Duration,
    sweep_interval: Duration,
}

impl<S: Store + 'static> Upkeep<S> {
    /// Upkeep for `store`, refunding reservations made under no lease once older than
    /// `recovery_age` (see [`recovery_age`]).
    pub fn new(store: Arc<S>, recovery_age: Duration) -> Upkeep<S> {
        Upkeep {
            store,
            recovery_age,
            lease_ttl: DEFAULT_LEASE_TTL,
            sweep_interval: DEFAULT_SWEEP_INTERVAL,
        }
    }

    /// How long the lease holds without renewal (default [`DEFAULT_LEASE_TTL`]); it is renewed,
    /// and dead instances looked for, every fifth of that (the heartbeat).
    pub fn lease_ttl(mut self, ttl: Duration) -> Upkeep<S> {
        self.lease_ttl = ttl.max(Duration::from_millis(500));
        self
    }

    /// How often the age rule and subscription lapses run (default
    /// [`DEFAULT_SWEEP_INTERVAL`]), at the first heartbeat after it is due.
    pub fn sweep_interval(mut self, interval: Duration) -> Upkeep<S> {
        self.sweep_interval = interval.max(Duration::from_millis(100));
        self
    }

    /// The time between two renewals of the lease.
    pub fn heartbeat(&self) -> Duration {
        self.lease_ttl / 5
    }

    /// Takes the lease and does a first pass (so a gateway restarted after a crash has refunded
    /// its predecessor's reservations before it serves), then keeps going in a task until
    /// [`UpkeepHandle::stop`].
    pub async fn start(self) -> Result<UpkeepHandle<S>, StoreError> {
        self.store.take_lease(Utc::now(), self.lease_ttl).await?;
        self.recover_orphans().await;
        self.sweep().await;
        let store = self.store.clone();
        let keeper = tokio::spawn(hold_lease(self.store.clone(), self.lease_ttl));
        let task = tokio::spawn(self.run());
        Ok(UpkeepHandle {
            store,
            task,
            keeper,
        })
    }

    async fn run(self) {
        let mut heartbeats = tokio::time::interval(self.heartbeat());
        heartbeats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        heartbeats.tick().await;
        let mut last_sweep = tokio::time::Instant::now();
        loop {
            heartbeats.tick().await;
            self.recover_orphans().await;
            if last_sweep.elapsed() >= self.sweep_interval {
                last_sweep = tokio::time::Instant::now();
                self.sweep().await;
            }
        }
    }

    /// Counts the reservations still not ended past the recovery age (`mg_overdue_reservations`),
    /// and logs them: credits no live call holds, which the operator should hear of.
    async fn count_overdue(&self) {
        let age = chrono::Duration::from_std(self.recovery_age).unwrap_or(chrono::Duration::MAX);
        match self.store.overdue_reservations(Utc::now() - age).await {
            Ok(overdue) => {
                crate::telemetry::overdue(overdue.calls);
                if overdue.calls > 0 {
                    tracing::error!(
                        calls = overdue.calls,
                        credits = %overdue.credits,
                        "reservations still pending past the longest a call can take"
                    );
                }
            }
            Err(error) => tracing::warn!(%error, "counting overdue reservations failed"),
        }
    }

    async fn recover_orphans(&self) {
        match recover_orphaned_reservations(self.store.as_ref()).await {
            Ok(refunded) if !refunded.is_empty() => tracing::warn!(
                count = refunded.len(),
                "refunded the reservations of a gateway instance that stopped"
            ),
            Ok(_) => {}
            Err(error) => {
                tracing::error!(%error, "recovering a stopped instance's reservations failed; will retry")
            }
        }
    }

    async fn sweep(&self) {
        match self.store.lapse_ended_subscriptions(Utc::now()).await {
            Ok(lapses) if !lapses.is_empty() => tracing::info!(
                accounts = lapses.len(),
                "subscription periods ended; their credits lapsed"
            ),
            Ok(_) => {}
            Err(error) => tracing::error!(%error, "lapsing ended subscriptions failed; will retry"),
        }
        match recover_stale_reservations(self.store.as_ref(), self.recovery_age).await {
            Ok(refunded) if !refunded.is_empty() => {
                tracing::warn!(count = refunded.len(), "refunded stale reservations");
            }
            Ok(_) => {}
            Err(error) => tracing::error!(%error, "recovery pass failed; will retry"),
        }
        self.count_overdue().await;
        if let Err(error) = self.store.forget_ended_leases(Utc::now()).await {
            tracing::warn!(%error, "forgetting ended instance leases failed; will retry");
        }
        let kept_since = Utc::now() - crate::store::RESPONSE_RETENTION;
        match self.store.forget_responses(kept_since).await {
            Ok(0) => {}
            Ok(forgotten) => {
                tracing::info!(forgotten, "owners of expired stored responses forgotten")
            }
            Err(error) => {
                tracing::warn!(%error, "forgetting expired stored responses failed; will retry")
            }
        }
        match self.store.forget_idempotent_calls(Utc::now()).await {
            Ok(0) => {}
            Ok(forgotten) => {
                tracing::info!(forgotten, "idempotency keys past their window forgotten")
            }
            Err(error) => {
                tracing::warn!(%error, "forgetting old idempotency keys failed; will retry")
            }
        }
    }
}

/// Pause between attempts to renew a lease that could not be renewed.
const RENEW_RETRY: Duration = Duration::from_millis(250);

/// Renews the lease every heartbeat, on a task of its own so that a slow recovery pass never
/// delays it. A renewal that fails (or takes longer than a heartbeat) is tried again every
/// 250 ms until it holds, so that the lease outlives an outage of the database shorter than
/// its time to live less a heartbeat; the store refuses to reserve under a lease it could not
/// renew in time (see [`Leases::renew_lease`]).
async fn hold_lease<S: Store + ?Sized>(store: Arc<S>, ttl: Duration) {
    let heartbeat = ttl / 5;
    loop {
        tokio::time::sleep(heartbeat).await;
        loop {
            let attempt = tokio::time::timeout(heartbeat, keep_lease(store.as_ref(), ttl)).await;
            if matches!(attempt, Ok(true)) {
                break;
            }
            tokio::time::sleep(RENEW_RETRY).await;
        }
    }
}

/// Renews the lease, or takes a new one if it had ended; whether the store holds one now.
async fn keep_lease<S: Store + ?Sized>(store: &S, ttl: Duration) -> bool {
    match store.renew_lease(Utc::now(), ttl).await {
        Ok(true) => return true,
        Ok(false) => tracing::error!(
            "this gateway's instance lease had ended (the database was out of reach for \
             longer than the lease); calls under way may have been refunded by recovery and \
             will not be billed; taking a new lease"
        ),
        Err(error) => {
            tracing::warn!(%error, "renewing the instance lease failed; will retry");
            return false;
        }
    }
    match store.take_lease(Utc::now(), ttl).await {
        Ok(_) => true,
        Err(error) => {
            tracing::error!(%error, "taking a new instance lease failed; will retry");
            false
        }
    }
}

/// The running [`Upkeep`]; [`stop`](UpkeepHandle::stop) it on a clean shutdown.
#[derive(Debug)]
pub struct UpkeepHandle<S> {
    store: Arc<S>,
    task: tokio::task::JoinHandle<()>,
    keeper: tokio::task::JoinHandle<()>,
}

impl<S: Store + 'static> UpkeepHandle<S> {
    /// Stops the upkeep and ends the lease, so that whatever of it is still pending is
    /// recovered at once by any instance (after a clean shutdown, nothing should be).
    pub async fn stop(self) {
        self.task.abort();
        self.keeper.abort();
        let _ = self.task.await;
        let _ = self.keeper.await;
        if let Err(error) = self.store.release_lease().await {
            tracing::warn!(%error, "ending the instance lease failed; it will expire");
        }
    }
}

/// How far past the catalogue's call deadline [`stack`](crate::stack) bounds an upstream call. The HTTP
/// upstream stops at the deadline itself; this bound catches any other upstream.
pub const UPSTREAM_BOUND_MARGIN: std::time::Duration = std::time::Duration::from_secs(30);

/// How old a `pending` reservation must be before recovery refunds it, for gateways built with
/// [`stack`](crate::stack) on `catalogue`: the upstream bound, plus the stream deadline when streaming is on,
/// plus a minute for settling and refunding.
pub fn recovery_age(catalogue: &Catalogue) -> std::time::Duration {
    let streams = if catalogue.streaming() {
        catalogue.stream_deadline()
    } else {
        std::time::Duration::ZERO
    };
    catalogue.call_deadline() + UPSTREAM_BOUND_MARGIN + streams + std::time::Duration::from_secs(60)
}
