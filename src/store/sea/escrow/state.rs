//! What an instance's escrow keeps in memory, and its settings: a leaf that the escrow's
//! parts share (see `super`).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use chrono::{DateTime, Utc};
use sea_orm::DatabaseConnection;
use tokio::sync::{mpsc, oneshot};

use crate::credits::{Balance, Credits, Split};
use crate::store::rules;
use crate::store::sea::held::HeldCall;
use crate::store::sea::writes::OwnedCharge;
use crate::store::{AccountId, CallFailure, CallId, CallSuccess, LeaseId, StoreError};

/// How long an account's escrow may sit with no call held against it before what it has free
/// goes back to the account (it goes back after this to twice this):
/// [`SeaOrmStore::with_escrow`](crate::store::SeaOrmStore::with_escrow)'s default.
pub const DEFAULT_ESCROW_IDLE: std::time::Duration = std::time::Duration::from_secs(5);

/// How many calls' worth of credits a refill takes at most, at first.
pub(super) const SLICE_CALLS: i64 = 64;

/// The most calls' worth a refill takes: an escrow refilled again within
/// [`REFILLED_SOON`] of its last refill takes twice its last slice, up to this. A hot account
/// then costs its instance one refill per 1024 calls, not per 64.
pub(super) const MAX_SLICE_CALLS: i64 = 1024;

/// See [`MAX_SLICE_CALLS`].
pub(super) const REFILLED_SOON: std::time::Duration = std::time::Duration::from_millis(250);

/// How long a reservation refused for credits that other instances hold in escrow waits for
/// them to give back what they have free (see [`Escrow::recall`]).
pub(super) const RECALL_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The `PostgreSQL` channel on which an instance asks the others to give back an account's
/// free escrow; the payload is `schema:account`.
pub(super) const RECALL_CHANNEL: &str = "mg_escrow_recall";

/// Most reads, or settles and refunds, that one statement or transaction carries.
pub(super) const MAX_BATCH: usize = 64;

/// How many call ids are taken from the sequence at a time.
pub(super) const ID_BLOCK: i64 = 256;

/// An escrow pot's key: one account's escrow under one instance lease (its row in
/// `mg_escrows`), each half named so that the two cannot be swapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct PotKey {
    pub(super) lease: LeaseId,
    pub(super) account: AccountId,
}

impl PotKey {
    pub(super) fn new(lease: LeaseId, account: AccountId) -> PotKey {
        PotKey { lease, account }
    }
}

/// What an instance keeps for its escrow on one account under one lease.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Pot {
    /// The escrow row as this instance last wrote or read it.
    pub(super) row: Balance,
    /// What held calls take from it.
    pub(super) held: Balance,
    /// A refill or a give-back is being written: no call may be held against the row until it
    /// is known (a call held on credits being given back would find them gone at its end).
    pub(super) writing: bool,
    /// A call was held against it since the last look for idle escrow.
    pub(super) touched: bool,
    /// The last refill: when, and how many calls' worth it could take.
    pub(super) refilled: Option<(std::time::Instant, i64)>,
    /// The account's subscription period when the escrow was last refilled. Once the account
    /// is in another (a lapse took what the escrow had of the old one), its subscription
    /// credits here are not spent before a refill reads the row again.
    pub(super) period_end: Option<DateTime<Utc>>,
    /// The id of the account's last lapse when the escrow was last refilled: a lapse since
    /// (a renewal to the same period end lapses what was left, and leaves the period as it
    /// was) took the escrow's subscription credits too, save what its held calls hold.
    pub(super) last_lapse: i64,
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) pots: HashMap<PotKey, Pot>,
    pub(super) calls: HashMap<CallId, HeldCall>,
    pub(super) ids: VecDeque<i64>,
}

impl State {
    /// What is held on `account`, under every lease.
    fn held_on(&self, account: AccountId) -> Balance {
        self.pots
            .iter()
            .filter(|(key, _)| key.account == account)
            .fold(Balance::default(), |sum, (_, pot)| sum.and(pot.held))
    }

    /// Whether what each pot holds is the sum of the calls held on it.
    pub(super) fn sums_agree(&self) -> bool {
        rules::holds::sums_agree(
            self.pots.iter().map(|(key, pot)| (*key, pot.held)),
            self.calls.values().map(|held| {
                let lease = held.charge.instance.unwrap_or(LeaseId(0));
                (PotKey::new(lease, held.account), held.taken)
            }),
        )
    }
}

/// What the shared read tells a reservation: its key is active, and its account's subscription.
#[derive(Debug, Clone, Copy)]
pub(super) struct Seen {
    /// Subscription credits in the account's row.
    pub(super) row_subscription: i64,
    pub(super) subscription_ends_at: Option<DateTime<Utc>>,
    /// The id of the account's last lapse (0: none).
    pub(super) last_lapse: i64,
    /// The key has a spending limit: its calls are reserved in the database, whose write
    /// checks the limit for every instance at once, not against escrow.
    pub(super) limited: bool,
}

pub(super) struct KeyRead {
    pub(super) key: i64,
    pub(super) answer: oneshot::Sender<Result<Option<Seen>, StoreError>>,
}

// Most calls settle: boxing the settle would allocate on every call to save space on refunds.
#[allow(clippy::large_enum_variant)]
pub(super) enum Ending {
    Settle(CallSuccess),
    Refund(CallFailure),
}

pub(super) struct EndJob {
    pub(super) call: CallId,
    pub(super) ending: Ending,
    pub(super) answer: oneshot::Sender<Result<bool, StoreError>>,
}

/// An instance's escrow: its holds, and the tasks that read keys and write endings.
#[derive(Debug)]
pub(in crate::store::sea) struct Escrow {
    pub(super) db: DatabaseConnection,
    pub(super) state: Mutex<State>,
    /// Escrow rows are written by one writer at a time (a refill, a batch of endings, a
    /// return), so that the rows in memory are exactly what each last wrote.
    pub(super) writer: Arc<tokio::sync::Mutex<()>>,
    /// One id block fetched at a time.
    pub(super) fetching_ids: tokio::sync::Mutex<()>,
    pub(super) reads: mpsc::Sender<KeyRead>,
    pub(super) endings: mpsc::Sender<EndJob>,
    /// Dropped with the escrow: the task answering recalls ends.
    pub(super) _answering_recalls: oneshot::Sender<()>,
    /// The store's event settings: a refill leaves an account's low-balance threshold in its
    /// row.
    pub(super) events: Arc<crate::store::sea::alerting::EventSettings>,
}

impl std::fmt::Debug for KeyRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyRead").field("key", &self.key).finish()
    }
}

impl std::fmt::Debug for EndJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndJob").field("call", &self.call).finish()
    }
}

/// What a refill came to.
pub(super) enum Refill {
    /// Another call refilled the escrow meanwhile: try it.
    Again,
    /// Refilled (or given back, for an account running low); the account row as the refill
    /// left it.
    Done { seen: Seen },
    /// The instance's lease no longer holds: nothing written.
    LeaseEnded,
}

/// Why a reservation could not be held at once.
pub(super) enum Short {
    /// No free id: fetch a block.
    Ids,
    /// The escrow cannot pay (or must swap top-up for subscription credits): refill.
    Credits,
}

impl Escrow {
    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// How many calls are held now.
    pub(in crate::store::sea) fn held_calls(&self) -> usize {
        self.state().calls.len()
    }

    /// The held calls reserved before `cutoff`.
    pub(in crate::store::sea) fn held_before(
        &self,
        cutoff: DateTime<Utc>,
    ) -> crate::store::Overdue {
        crate::store::sea::held::older_than(self.state().calls.values(), cutoff)
    }

    /// Whether `call` is held here (and so ends here).
    pub(in crate::store::sea) fn holds(&self, call: CallId) -> bool {
        self.state().calls.contains_key(&call)
    }

    /// What is held on `account` in memory.
    pub(in crate::store::sea) fn held_on(&self, account: AccountId) -> Balance {
        self.state().held_on(account)
    }

    /// Holds the escrow's writer: no call ends and no refill is written until the guard drops.
    pub(in crate::store::sea) async fn pause_writes(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.writer.lock().await
    }

    /// Whether the pot `key` has subscription credits that no held call takes.
    pub(super) fn has_free_subscription(&self, key: PotKey) -> bool {
        self.state()
            .pots
            .get(&key)
            .is_some_and(|pot| pot.row.subscription > pot.held.subscription)
    }

    /// The subscription credits held calls take from `account`'s escrow, by lease.
    pub(in crate::store::sea) fn subscription_held(
        &self,
        account: AccountId,
    ) -> Vec<(LeaseId, Credits)> {
        self.state()
            .pots
            .iter()
            .filter(|(key, pot)| key.account == account && pot.held.subscription > Credits::ZERO)
            .map(|(key, pot)| (key.lease, pot.held.subscription))
            .collect()
    }
}

/// What `charge` would hold of the escrow pot `key`, if the pot can pay it now.
pub(super) fn what_to_hold(
    state: &State,
    charge: &OwnedCharge,
    key: PotKey,
    seen: Seen,
) -> Result<Split, Short> {
    let pot = state.pots.get(&key).copied().unwrap_or_default();
    let pot = rules::escrow::Pot {
        row: pot.row,
        held: pot.held,
        writing: pot.writing,
        period_end: pot.period_end,
        last_lapse: pot.last_lapse,
    };
    let account = rules::escrow::AccountRow {
        subscription: Credits(seen.row_subscription),
        subscription_ends_at: seen.subscription_ends_at,
        last_lapse: seen.last_lapse,
    };
    rules::escrow::decide_pot_hold(pot, account, charge.at, charge.price).ok_or(Short::Credits)
}

pub(super) fn stopped() -> StoreError {
    StoreError::msg("the store's escrow tasks have stopped")
}
