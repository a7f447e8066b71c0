//! Credit escrow on `PostgreSQL` ([`SeaOrmStore::with_escrow`](super::SeaOrmStore::with_escrow)):
//! one write per call, and no account row in it.
//!
//! Without escrow a call costs two write transactions (reserve, then settle), and every
//! reservation on one account, from every instance, waits on that account's row. With escrow an
//! instance moves a slice of an account's credits into an escrow row of its own (`mg_escrows`,
//! one per account and instance lease), in a short transaction that locks the account row and
//! takes subscription credits first; only from an account with enough for many calls (an
//! account running low is charged in the database, where every instance sees the same credits).
//! Then:
//!
//! - **A reservation** is held in memory against that escrow, as on a `SQLite` file its store
//!   owns. It waits for no write, only for a read that it shares with the reservations waiting
//!   beside it: the caller's key must still be active (so a revocation that committed before the
//!   call arrived refuses it, on every instance) and the read brings the account's subscription
//!   credits and period, so that a subscription's credits stay first and none is spent after its
//!   period.
//! - **A settle** inserts its `ok` entry and debits the instance's escrow row, guarded by
//!   `bucket >= debit`; **a refund** inserts a `refunded` entry and moves nothing. Both go in
//!   batches, one transaction each, durable before they are answered. A held call whose credits
//!   were taken from the escrow meanwhile (a lapse) ends `refunded`, unbilled.
//! - **The escrow comes back** to the account row: at a refill (what is free goes back, and a
//!   new slice is taken, so subscription credits granted since are spent before top-up ones
//!   still in escrow), once no call has been held against it for a while (what is free: so
//!   that other instances can spend an idle account's credits), when another instance recalls
//!   it (a call it reserved in the database was refused for credits that this one holds free:
//!   `NOTIFY mg_escrow_recall`), when the instance releases its lease, and after a crash or a
//!   lost lease, when recovery finds an escrow row whose lease has ended.
//!
//! Escrowed credits are the account's: the balance, the account listings and the audit count
//! them, and a lapse takes a subscription's escrowed credits with the rest. What this instance
//! holds in memory is counted as spent in the balance it shows. A crash loses only holds, which
//! moved no credits, so recovery has nothing to refund for them.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use chrono::{DateTime, Utc};
use sea_orm::sea_query::{Expr, LockType};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseConnection, DbBackend, EntityTrait, QueryFilter,
    QuerySelect, Set, Statement, TransactionTrait,
};
use tokio::sync::{mpsc, oneshot};

use super::batch::{Finish, OwnedCharge, unknown_account};
use super::entity::{account, escrow, instance};
use super::holds::HeldCall;
use crate::credits::{Balance, Credits, Split};
use crate::store::{
    AccountId, CallFailure, CallId, CallStatus, CallSuccess, Reservation, ReserveError, StoreError,
};

/// How long an account's escrow may sit with no call held against it before what it has free
/// goes back to the account (it goes back after this to twice this):
/// [`SeaOrmStore::with_escrow`](super::SeaOrmStore::with_escrow)'s default.
pub const DEFAULT_ESCROW_IDLE: std::time::Duration = std::time::Duration::from_secs(5);

/// How many calls' worth of credits a refill takes at most, at first.
const SLICE_CALLS: i64 = 64;

/// The most calls' worth a refill takes: an escrow refilled again within
/// [`REFILLED_SOON`] of its last refill takes twice its last slice, up to this. A hot account
/// then costs its instance one refill per 1024 calls, not per 64.
const MAX_SLICE_CALLS: i64 = 1024;

/// See [`MAX_SLICE_CALLS`].
const REFILLED_SOON: std::time::Duration = std::time::Duration::from_millis(250);

/// A slice is never more than this share of what the account has to spend (1/8), so that other
/// instances find some, and so that what an instance holds when the account runs low is small.
const SLICE_SHARE: i64 = 8;

/// How many calls' worth an account must have to spend (in its row and this instance's free
/// escrow) for a refill to take a slice. Below that its calls are reserved in the database,
/// where every instance sees the same credits, so that an account running low is refused only
/// when it cannot pay, save for what other instances still have in escrow (what each took at
/// its last refill, at most an eighth of what the account had then).
const ESCROW_FROM_CALLS: i64 = 256;

/// How long a reservation refused for credits that other instances hold in escrow waits for
/// them to give back what they have free (see [`Escrow::recall`]).
const RECALL_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The `PostgreSQL` channel on which an instance asks the others to give back an account's
/// free escrow; the payload is `schema:account`.
const RECALL_CHANNEL: &str = "mg_escrow_recall";

/// Most reads, or settles and refunds, that one statement or transaction carries.
const MAX_BATCH: usize = 64;

/// How many call ids are taken from the sequence at a time.
const ID_BLOCK: i64 = 256;

/// What an instance keeps for its escrow on one account under one lease.
#[derive(Debug, Default, Clone, Copy)]
struct Pot {
    /// The escrow row as this instance last wrote or read it.
    row: Balance,
    /// What held calls take from it.
    held: Balance,
    /// A refill or a give-back is being written: no call may be held against the row until it
    /// is known (a call held on credits being given back would find them gone at its end).
    writing: bool,
    /// A call was held against it since the last look for idle escrow.
    touched: bool,
    /// The last refill: when, and how many calls' worth it could take.
    refilled: Option<(std::time::Instant, i64)>,
    /// The account's subscription period when the escrow was last refilled. Once the account
    /// is in another (a lapse took what the escrow had of the old one), its subscription
    /// credits here are not spent before a refill reads the row again.
    period_end: Option<DateTime<Utc>>,
}

#[derive(Debug, Default)]
struct State {
    /// Keyed by (lease, account).
    pots: HashMap<(i64, i64), Pot>,
    calls: HashMap<i64, HeldCall>,
    ids: VecDeque<i64>,
}

impl State {
    /// What is held on `account`, under every lease.
    fn held_on(&self, account: i64) -> Balance {
        self.pots.iter().filter(|((_, id), _)| *id == account).fold(
            Balance::default(),
            |sum, (_, pot)| Balance {
                subscription: Credits(sum.subscription.0 + pot.held.subscription.0),
                topup: Credits(sum.topup.0 + pot.held.topup.0),
            },
        )
    }
}

/// What the shared read tells a reservation: its key is active, and its account's subscription.
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// Subscription credits in the account's row.
    row_subscription: i64,
    subscription_ends_at: Option<DateTime<Utc>>,
}

struct KeyRead {
    key: i64,
    answer: oneshot::Sender<Result<Option<Seen>, StoreError>>,
}

enum Ending {
    Settle(CallSuccess),
    Refund(CallFailure),
}

struct EndJob {
    call: i64,
    ending: Ending,
    answer: oneshot::Sender<Result<bool, StoreError>>,
}

/// An instance's escrow: its holds, and the tasks that read keys and write endings.
#[derive(Debug)]
pub(super) struct Escrow {
    db: DatabaseConnection,
    state: Mutex<State>,
    /// Escrow rows are written by one writer at a time (a refill, a batch of endings, a
    /// return), so that the rows in memory are exactly what each last wrote.
    writer: Arc<tokio::sync::Mutex<()>>,
    /// One id block fetched at a time.
    fetching_ids: tokio::sync::Mutex<()>,
    reads: mpsc::Sender<KeyRead>,
    endings: mpsc::Sender<EndJob>,
    /// Dropped with the escrow: the task answering recalls ends.
    _answering_recalls: oneshot::Sender<()>,
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
enum Refill {
    /// Another call refilled the escrow meanwhile: try it.
    Again,
    /// Refilled (or given back, for an account running low); the account row as the refill
    /// left it.
    Done { seen: Seen },
    /// The instance's lease no longer holds: nothing written.
    LeaseEnded,
}

/// Why a reservation could not be held at once.
enum Short {
    /// No free id: fetch a block.
    Ids,
    /// The escrow cannot pay (or must swap top-up for subscription credits): refill.
    Credits,
}

impl Escrow {
    /// Starts the key reader, the writer of endings and the look for idle escrow (every
    /// `idle`) on the current runtime; each ends with the last clone of the store.
    pub(super) fn start(db: DatabaseConnection, idle: std::time::Duration) -> Arc<Escrow> {
        let (reads, read_queue) = mpsc::channel(4096);
        let (endings, ending_queue) = mpsc::channel(4096);
        let (answering_recalls, stop_answering) = oneshot::channel();
        let escrow = Arc::new(Escrow {
            db: db.clone(),
            state: Mutex::default(),
            writer: Arc::default(),
            fetching_ids: tokio::sync::Mutex::default(),
            reads,
            endings,
            _answering_recalls: answering_recalls,
        });
        tokio::spawn(read_keys(db, read_queue));
        tokio::spawn(write_endings(Arc::downgrade(&escrow), ending_queue));
        tokio::spawn(give_back_idle(Arc::downgrade(&escrow), idle));
        #[cfg(feature = "postgres")]
        tokio::spawn(answer_recalls(Arc::downgrade(&escrow), stop_answering));
        #[cfg(not(feature = "postgres"))]
        drop(stop_answering);
        escrow
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// How many calls are held now.
    pub(super) fn held_calls(&self) -> usize {
        self.state().calls.len()
    }

    /// The held calls reserved before `cutoff`.
    pub(super) fn held_before(&self, cutoff: DateTime<Utc>) -> crate::store::Overdue {
        super::holds::older_than(self.state().calls.values(), cutoff)
    }

    /// Whether `call` is held here (and so ends here).
    pub(super) fn holds(&self, call: CallId) -> bool {
        self.state().calls.contains_key(&call.0)
    }

    /// What is held on `account` in memory.
    pub(super) fn held_on(&self, account: i64) -> Balance {
        self.state().held_on(account)
    }

    /// Holds the escrow's writer: no call ends and no refill is written until the guard drops.
    pub(super) async fn pause_writes(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.writer.lock().await
    }

    /// Whether `account`'s escrow under `lease` has subscription credits that no held call
    /// takes.
    pub(super) fn has_free_subscription(&self, lease: i64, account: i64) -> bool {
        self.state()
            .pots
            .get(&(lease, account))
            .is_some_and(|pot| pot.row.subscription > pot.held.subscription)
    }

    /// The subscription credits held calls take from `account`'s escrow, by lease.
    pub(super) fn subscription_held(&self, account: i64) -> Vec<(i64, Credits)> {
        self.state()
            .pots
            .iter()
            .filter(|((_, id), pot)| *id == account && pot.held.subscription > Credits::ZERO)
            .map(|((lease, _), pot)| (*lease, pot.held.subscription))
            .collect()
    }

    /// Reserves `charge` against this instance's escrow under its lease, refilling the escrow
    /// when it cannot pay. `None`: the account has too little for escrow (what this instance
    /// had free of it is back in its row); reserve it in the database.
    pub(super) async fn reserve(
        &self,
        charge: &OwnedCharge,
        lease: i64,
    ) -> Result<Option<Reservation>, ReserveError> {
        let (answer, answered) = oneshot::channel();
        let read = KeyRead {
            key: charge.caller.key.0,
            answer,
        };
        self.reads.send(read).await.map_err(|_| stopped())?;
        let mut seen = answered
            .await
            .map_err(|_| stopped())??
            .ok_or(ReserveError::KeyRevoked)?;
        let mut refilled = false;
        loop {
            match self.try_hold(charge, lease, seen) {
                Ok(reservation) => return Ok(Some(reservation)),
                Err(Short::Ids) => self.fetch_ids().await?,
                Err(Short::Credits) if refilled => return Ok(None),
                Err(Short::Credits) => match self.refill(charge, lease, seen).await? {
                    Refill::Again => {}
                    Refill::Done { seen: after } => {
                        seen = after;
                        refilled = true;
                    }
                    // Its lease has ended (recovery may give the escrow back at any moment):
                    // reserve in the database until the store holds a new one.
                    Refill::LeaseEnded => return Ok(None),
                },
            }
        }
    }

    fn try_hold(&self, charge: &OwnedCharge, lease: i64, seen: Seen) -> Result<Reservation, Short> {
        let account = charge.caller.account.0;
        let mut state = self.state();
        let taken = what_to_hold(&state, charge, lease, seen)?;
        let id = state.ids.pop_front().ok_or(Short::Ids)?;
        let pot = state.pots.entry((lease, account)).or_default();
        pot.held = pot.held.plus(taken);
        pot.touched = true;
        let mut held = charge.clone();
        held.instance = Some(lease);
        state.calls.insert(
            id,
            HeldCall {
                account,
                charge: held,
                taken,
                reserved_at: Utc::now(),
            },
        );
        Ok(Reservation {
            call: CallId(id),
            account: AccountId(account),
            taken,
        })
    }

    async fn fetch_ids(&self) -> Result<(), StoreError> {
        let _one = self.fetching_ids.lock().await;
        if !self.state().ids.is_empty() {
            return Ok(());
        }
        let sql = "SELECT nextval(pg_get_serial_sequence('mg_calls', 'id')) \
                   FROM generate_series(1, $1::bigint)";
        let rows = self
            .db
            .query_all_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                sql,
                [ID_BLOCK.into()],
            ))
            .await?;
        let ids = rows
            .iter()
            .map(|row| row.try_get_by_index::<i64>(0))
            .collect::<Result<Vec<_>, _>>()?;
        self.state().ids.extend(ids);
        Ok(())
    }

    /// Gives back what the escrow has free on `charge`'s account and takes a new slice, subscription
    /// credits first, in one transaction.
    async fn refill(
        &self,
        charge: &OwnedCharge,
        lease: i64,
        seen: Seen,
    ) -> Result<Refill, ReserveError> {
        let _writer = self.writer.lock().await;
        if what_to_hold(&self.state(), charge, lease, seen).is_ok() {
            return Ok(Refill::Again);
        }
        let account = charge.caller.account.0;
        let (held, slice_calls) = {
            let mut state = self.state();
            let pot = state.pots.entry((lease, account)).or_default();
            pot.writing = true;
            let slice_calls = match pot.refilled {
                Some((at, calls)) if at.elapsed() < REFILLED_SOON => {
                    Ord::min(calls.saturating_mul(2), MAX_SLICE_CALLS)
                }
                _ => SLICE_CALLS,
            };
            (pot.held, slice_calls)
        };
        let written = self.write_refill(charge, lease, held, slice_calls).await;
        let mut state = self.state();
        let pot = state.pots.entry((lease, account)).or_default();
        pot.writing = false;
        let Some((row, seen)) = written? else {
            return Ok(Refill::LeaseEnded);
        };
        pot.refilled = Some((std::time::Instant::now(), slice_calls));
        pot.row = row;
        pot.period_end = seen.subscription_ends_at;
        Ok(Refill::Done { seen })
    }

    async fn write_refill(
        &self,
        charge: &OwnedCharge,
        lease: i64,
        held: Balance,
        slice_calls: i64,
    ) -> Result<Option<(Balance, Seen)>, ReserveError> {
        let account = charge.caller.account.0;
        let txn = self.db.begin().await?;
        let row = account::Entity::find_by_id(account)
            .lock(LockType::NoKeyUpdate)
            .one(&txn)
            .await?
            .ok_or_else(|| unknown_account(AccountId(account)))?;
        let now = Utc::now();
        let live = instance::Entity::find_by_id(lease)
            .filter(instance::Column::ExpiresAt.gt(now))
            .one(&txn)
            .await?
            .is_some();
        if !live {
            txn.rollback().await?;
            return Ok(None);
        }
        let stored = escrow_row(&txn, account, lease).await?;
        // What no held call counts on goes back to the row, then a new slice is taken from it.
        let free = stored.free_of(held);
        let pool = Balance {
            subscription: Credits(row.subscription_credits + free.subscription.0),
            topup: Credits(row.topup_credits + free.topup.0),
        };
        let spendable = pool.spendable(row.subscription_ends_at, charge.at);
        // A slice, or at most an eighth of what is there; nothing from an account running low.
        let want = if spendable.total().0 >= charge.price.0.saturating_mul(ESCROW_FROM_CALLS) {
            Ord::min(
                charge.price.0.saturating_mul(slice_calls),
                spendable.total().0 / SLICE_SHARE,
            )
        } else {
            0
        };
        let from_subscription = Ord::min(spendable.subscription.0, want);
        let take = Split {
            subscription: Credits(from_subscription),
            topup: Credits(Ord::min(spendable.topup.0, want - from_subscription)),
        };
        let left = pool.minus(take);
        let escrowed = Balance {
            subscription: Credits(stored.subscription.0 - free.subscription.0),
            topup: Credits(stored.topup.0 - free.topup.0),
        }
        .plus(take);
        account::Entity::update_many()
            .col_expr(
                account::Column::SubscriptionCredits,
                Expr::value(left.subscription.0),
            )
            .col_expr(account::Column::TopupCredits, Expr::value(left.topup.0))
            .filter(account::Column::Id.eq(account))
            .exec(&txn)
            .await?;
        write_escrow_row(&txn, account, lease, escrowed).await?;
        txn.commit().await?;
        let seen = Seen {
            row_subscription: left.subscription.0,
            subscription_ends_at: row.subscription_ends_at,
        };
        Ok(Some((escrowed, seen)))
    }

    /// Ends a held call: its entry is written, finished, in the next batch.
    async fn end(&self, call: CallId, ending: Ending) -> Result<bool, StoreError> {
        let (answer, answered) = oneshot::channel();
        let job = EndJob {
            call: call.0,
            ending,
            answer,
        };
        self.endings.send(job).await.map_err(|_| stopped())?;
        answered.await.map_err(|_| stopped())?
    }

    /// Settles a held call.
    pub(super) async fn settle(
        &self,
        call: CallId,
        success: CallSuccess,
    ) -> Result<bool, StoreError> {
        self.end(call, Ending::Settle(success)).await
    }

    /// Refunds a held call.
    pub(super) async fn refund(
        &self,
        call: CallId,
        failure: &CallFailure,
    ) -> Result<bool, StoreError> {
        self.end(call, Ending::Refund(failure.clone())).await
    }

    /// Gives back to their accounts what this instance's escrow rows under `lease` have free
    /// (all of it when no call is held), as on a clean stop; only `account`'s, if given.
    pub(super) async fn give_back(
        &self,
        lease: i64,
        account: Option<i64>,
    ) -> Result<(), StoreError> {
        self.give_back_where(|&(of, id), _| {
            of == lease && account.is_none_or(|account| account == id)
        })
        .await?;
        Ok(())
    }

    /// Gives back what this instance's escrow rows for `account` have free (under any lease);
    /// returns how many rows it gave back.
    #[cfg(feature = "postgres")]
    async fn give_back_account(&self, account: i64) -> Result<usize, StoreError> {
        self.give_back_where(|&(_, id), pot| {
            id == account && pot.row.free_of(pot.held) != Balance::default()
        })
        .await
    }

    /// Gives back what the escrow rows that `pick` picks have free, one at a time (see
    /// [`give_back_pot`](Self::give_back_pot)); returns how many it picked.
    async fn give_back_where(
        &self,
        mut pick: impl FnMut(&(i64, i64), &mut Pot) -> bool,
    ) -> Result<usize, StoreError> {
        let pots: Vec<(i64, i64)> = self
            .state()
            .pots
            .iter_mut()
            .filter_map(|(key, pot)| pick(key, pot).then_some(*key))
            .collect();
        for pot in &pots {
            self.give_back_pot(*pot).await?;
        }
        Ok(pots.len())
    }

    /// Brings back the credits other instances hold in escrow for `account`, for a reservation
    /// refused for credits. Escrow under a lease that has ended (its instance crashed or lost
    /// it) is given back here and now, as recovery would give it back on its next round. The
    /// instances whose leases hold (other than `lease`) are asked to give back what they have
    /// free, and the call waits until the credits they hold for it fall (a give-back, or a call
    /// of theirs ending), for at most [`RECALL_WAIT`]. `true`: credits came back, and the
    /// reservation may be tried again; `false`: none are held elsewhere, or none came back in
    /// time.
    pub(super) async fn recall(&self, account: i64, lease: i64) -> Result<bool, StoreError> {
        let now = Utc::now();
        if give_back_ended(&self.db, now, Some(account)).await? > 0 {
            return Ok(true);
        }
        let before = self.escrowed_elsewhere(account, lease, now).await?;
        if before == 0 {
            return Ok(false);
        }
        self.db
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "SELECT pg_notify($1, current_schema() || ':' || $2::bigint::text)",
                [RECALL_CHANNEL.into(), account.into()],
            ))
            .await?;
        let deadline = tokio::time::Instant::now() + RECALL_WAIT;
        let mut pause = std::time::Duration::from_millis(2);
        while tokio::time::Instant::now() + pause < deadline {
            tokio::time::sleep(pause).await;
            if self.escrowed_elsewhere(account, lease, now).await? < before {
                return Ok(true);
            }
            pause = Ord::min(pause * 2, std::time::Duration::from_millis(128));
        }
        Ok(false)
    }

    /// The credits escrow rows for `account` hold under leases that hold at `now`, other than
    /// `lease`.
    async fn escrowed_elsewhere(
        &self,
        account: i64,
        lease: i64,
        now: DateTime<Utc>,
    ) -> Result<i64, StoreError> {
        let rows = escrow::Entity::find()
            .filter(escrow::Column::AccountId.eq(account))
            .filter(escrow::Column::InstanceId.ne(lease))
            .filter(escrow::Column::InstanceId.in_subquery(super::leases::live(now)))
            .all(&self.db)
            .await?;
        Ok(rows
            .iter()
            .map(|row| row.subscription_credits + row.topup_credits)
            .sum())
    }

    /// Gives back what an escrow row has free, in a transaction of its own under the writer;
    /// no call is held against the row meanwhile. A row left with nothing, and no call held on
    /// it, is forgotten.
    async fn give_back_pot(&self, (lease, account): (i64, i64)) -> Result<(), StoreError> {
        let _writer = self.writer.lock().await;
        let held = {
            let mut state = self.state();
            let Some(pot) = state.pots.get_mut(&(lease, account)) else {
                return Ok(());
            };
            pot.writing = true;
            pot.held
        };
        let written = async {
            let txn = self.db.begin().await?;
            let kept = return_free(&txn, account, lease, held).await?;
            txn.commit().await?;
            Ok::<_, StoreError>(kept)
        }
        .await;
        let mut state = self.state();
        let pot = state.pots.entry((lease, account)).or_default();
        pot.writing = false;
        pot.row = written?;
        if pot.row == Balance::default() && pot.held == Balance::default() {
            state.pots.remove(&(lease, account));
        }
        Ok(())
    }

    /// Gives back what each escrow row has free if no call was held against it since the last
    /// look (so after one to two looks' time idle), and forgets empty rows; returns how many
    /// rows it gave back.
    async fn give_back_idle(&self) -> Result<usize, StoreError> {
        self.state().pots.retain(|_, pot| {
            pot.writing || pot.row != Balance::default() || pot.held != Balance::default()
        });
        self.give_back_where(|_, pot| {
            let touched = std::mem::take(&mut pot.touched);
            !touched && !pot.writing && pot.row.free_of(pot.held) != Balance::default()
        })
        .await
    }
}

/// Looks for idle escrow every `every` while the escrow is in use (see
/// [`Escrow::give_back_idle`]).
async fn give_back_idle(escrow: std::sync::Weak<Escrow>, every: std::time::Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(escrow) = escrow.upgrade() else {
            return;
        };
        match escrow.give_back_idle().await {
            Ok(0) => {}
            Ok(rows) => tracing::debug!(rows, "gave back idle escrow"),
            Err(error) => tracing::warn!(%error, "giving back idle escrow failed; will retry"),
        }
    }
}

/// Listens for recalls (see [`Escrow::recall`]) on a connection of the escrow's pool, and
/// gives back what this instance's escrow has free for each account recalled in its schema;
/// ends when the escrow is dropped. A recall missed (while reconnecting) only waits for the
/// idle look.
#[cfg(feature = "postgres")]
async fn answer_recalls(escrow: std::sync::Weak<Escrow>, mut stop: oneshot::Receiver<()>) {
    const RETRY: std::time::Duration = std::time::Duration::from_secs(1);
    let (schema, mut listener) = loop {
        let Some(live) = escrow.upgrade() else {
            return;
        };
        match listen_for_recalls(&live).await {
            Ok(listening) => break listening,
            Err(error) => tracing::warn!(%error, "listening for escrow recalls failed; will retry"),
        }
        drop(live);
        tokio::select! {
            _ = &mut stop => return,
            () = tokio::time::sleep(RETRY) => {}
        }
    };
    loop {
        let notification = tokio::select! {
            _ = &mut stop => return,
            notification = listener.recv() => notification,
        };
        let account = match &notification {
            Ok(notification) => notification
                .payload()
                .strip_prefix(schema.as_str())
                .and_then(|rest| rest.strip_prefix(':'))
                .and_then(|account| account.parse::<i64>().ok()),
            // The pool was closed: nothing more to listen for.
            Err(sea_orm::sqlx::Error::PoolClosed) => return,
            Err(error) => {
                // The next `recv` reconnects.
                tracing::warn!(%error, "listening for escrow recalls failed; will retry");
                tokio::select! {
                    _ = &mut stop => return,
                    () = tokio::time::sleep(RETRY) => {}
                }
                None
            }
        };
        let (Some(account), Some(escrow)) = (account, escrow.upgrade()) else {
            continue;
        };
        match escrow.give_back_account(account).await {
            Ok(0) => {}
            Ok(rows) => tracing::debug!(account, rows, "gave back recalled escrow"),
            Err(error) => tracing::warn!(%error, account, "giving back recalled escrow failed"),
        }
    }
}

/// This store's schema, and a listener on [`RECALL_CHANNEL`].
#[cfg(feature = "postgres")]
async fn listen_for_recalls(
    escrow: &Escrow,
) -> Result<(String, sea_orm::sqlx::postgres::PgListener), StoreError> {
    let schema = escrow
        .db
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT current_schema()",
        ))
        .await?
        .ok_or_else(|| StoreError::msg("no current schema"))?
        .try_get_by_index::<String>(0)?;
    let pool = escrow.db.get_postgres_connection_pool();
    let mut listener = sea_orm::sqlx::postgres::PgListener::connect_with(pool)
        .await
        .map_err(sql_error)?;
    listener.listen(RECALL_CHANNEL).await.map_err(sql_error)?;
    Ok((schema, listener))
}

#[cfg(feature = "postgres")]
fn sql_error(error: sea_orm::sqlx::Error) -> StoreError {
    StoreError::msg(format!("listening for escrow recalls: {error}"))
}

/// What `charge` would hold of the escrow under `lease`, if the escrow can pay it now.
fn what_to_hold(
    state: &State,
    charge: &OwnedCharge,
    lease: i64,
    seen: Seen,
) -> Result<Split, Short> {
    let pot = state
        .pots
        .get(&(lease, charge.caller.account.0))
        .copied()
        .unwrap_or_default();
    if pot.writing {
        return Err(Short::Credits);
    }
    let period = seen.subscription_ends_at;
    if pot.row.subscription > Credits::ZERO && period != pot.period_end {
        return Err(Short::Credits);
    }
    let spendable = pot.row.free_of(pot.held).spendable(period, charge.at);
    let taken = spendable.split_charge(charge.price).ok_or(Short::Credits)?;
    // Subscription credits first: while the account row has some to spend, top-up credits in
    // escrow wait (the refill swaps them).
    let row_subscription = Balance {
        subscription: Credits(seen.row_subscription),
        topup: Credits::ZERO,
    }
    .spendable(period, charge.at)
    .subscription;
    if taken.topup > Credits::ZERO && row_subscription > Credits::ZERO {
        return Err(Short::Credits);
    }
    Ok(taken)
}

fn stopped() -> StoreError {
    StoreError::msg("the store's escrow tasks have stopped")
}

/// An escrow row as stored, locked; zero if there is none.
async fn escrow_row<C: ConnectionTrait>(
    txn: &C,
    account: i64,
    lease: i64,
) -> Result<Balance, StoreError> {
    Ok(escrow::Entity::find_by_id((account, lease))
        .lock_exclusive()
        .one(txn)
        .await?
        .map(|row| Balance {
            subscription: Credits(row.subscription_credits),
            topup: Credits(row.topup_credits),
        })
        .unwrap_or_default())
}

/// Moves what an escrow row has free of `held` back to its account's row, both locked in
/// `txn` (account first, as every writer of both does); returns what the escrow row keeps.
///
/// The account row is locked `FOR NO KEY UPDATE` here and in a refill: what the update of its
/// credits takes anyway, and exclusive against every other writer, but unlike `FOR UPDATE` it
/// neither waits for nor blocks the `FOR KEY SHARE` locks that the foreign-key checks of
/// entries being inserted (by other instances' batches, for this account) take on it.
async fn return_free<C: ConnectionTrait>(
    txn: &C,
    account: i64,
    lease: i64,
    held: Balance,
) -> Result<Balance, StoreError> {
    let row = account::Entity::find_by_id(account)
        .lock(LockType::NoKeyUpdate)
        .one(txn)
        .await?
        .ok_or_else(|| unknown_account(AccountId(account)))?;
    let stored = escrow_row(txn, account, lease).await?;
    let free = stored.free_of(held);
    let kept = Balance {
        subscription: Credits(stored.subscription.0 - free.subscription.0),
        topup: Credits(stored.topup.0 - free.topup.0),
    };
    // An empty row (a lapse can leave one) is deleted all the same.
    write_escrow_row(txn, account, lease, kept).await?;
    if free == Balance::default() {
        return Ok(kept);
    }
    account::Entity::update_many()
        .col_expr(
            account::Column::SubscriptionCredits,
            Expr::value(row.subscription_credits + free.subscription.0),
        )
        .col_expr(
            account::Column::TopupCredits,
            Expr::value(row.topup_credits + free.topup.0),
        )
        .filter(account::Column::Id.eq(account))
        .exec(txn)
        .await?;
    Ok(kept)
}

/// Writes an escrow row (locked by [`escrow_row`]), deleting it when it is empty.
async fn write_escrow_row<C: ConnectionTrait>(
    txn: &C,
    account: i64,
    lease: i64,
    escrowed: Balance,
) -> Result<(), StoreError> {
    if escrowed == Balance::default() {
        escrow::Entity::delete_by_id((account, lease))
            .exec(txn)
            .await?;
        return Ok(());
    }
    let row = escrow::ActiveModel {
        account_id: Set(account),
        instance_id: Set(lease),
        subscription_credits: Set(escrowed.subscription.0),
        topup_credits: Set(escrowed.topup.0),
    };
    let on_conflict = sea_orm::sea_query::OnConflict::columns([
        escrow::Column::AccountId,
        escrow::Column::InstanceId,
    ])
    .update_columns([
        escrow::Column::SubscriptionCredits,
        escrow::Column::TopupCredits,
    ])
    .to_owned();
    escrow::Entity::insert(row)
        .on_conflict(on_conflict)
        .exec_without_returning(txn)
        .await?;
    Ok(())
}

/// The key reader: each read answers every reservation that was waiting when it began.
async fn read_keys(db: DatabaseConnection, mut queue: mpsc::Receiver<KeyRead>) {
    let mut waiting = Vec::with_capacity(MAX_BATCH);
    while queue.recv_many(&mut waiting, MAX_BATCH).await > 0 {
        let mut keys: Vec<i64> = waiting.iter().map(|read| read.key).collect();
        keys.sort_unstable();
        keys.dedup();
        let read = active_keys(&db, &keys).await;
        for KeyRead { key, answer } in waiting.drain(..) {
            let _ = answer.send(match &read {
                Ok(seen) => Ok(seen.get(&key).copied()),
                Err(error) => Err(StoreError::msg(format!("reading keys: {error}"))),
            });
        }
    }
}

async fn active_keys(
    db: &DatabaseConnection,
    keys: &[i64],
) -> Result<HashMap<i64, Seen>, StoreError> {
    let list = keys
        .iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let sql = "SELECT k.id, a.subscription_credits, a.subscription_ends_at \
               FROM mg_api_keys k JOIN mg_accounts a ON a.id = k.account_id \
               WHERE k.id = ANY($1::bigint[]) AND k.revoked_at IS NULL";
    let rows = db
        .query_all_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            sql,
            [format!("{{{list}}}").into()],
        ))
        .await?;
    let mut seen = HashMap::with_capacity(rows.len());
    for row in rows {
        let key: i64 = row.try_get_by_index(0)?;
        seen.insert(
            key,
            Seen {
                row_subscription: row.try_get_by_index(1)?,
                subscription_ends_at: row.try_get_by_index(2)?,
            },
        );
    }
    Ok(seen)
}

/// The writer of endings: each batch inserts its entries, finished, and debits the escrow
/// rows of its settles, in one transaction.
async fn write_endings(escrow: std::sync::Weak<Escrow>, mut queue: mpsc::Receiver<EndJob>) {
    let mut jobs = Vec::with_capacity(MAX_BATCH);
    while queue.recv_many(&mut jobs, MAX_BATCH).await > 0 {
        let Some(escrow) = escrow.upgrade() else {
            return;
        };
        let answers = match write_batch(&escrow, &jobs).await {
            Ok(answers) => answers.into_iter().map(Ok).collect(),
            Err(error) => {
                let message = error.to_string();
                jobs.iter()
                    .map(|_| Err(StoreError::msg(message.clone())))
                    .collect::<Vec<_>>()
            }
        };
        for (job, answer) in jobs.drain(..).zip(answers) {
            let _ = job.answer.send(answer);
        }
    }
}

/// The escrow row a held call was held against: (lease, account).
fn pot_of(held: &HeldCall) -> (i64, i64) {
    (held.charge.instance.unwrap_or_default(), held.account)
}

/// How one held call ends in a batch.
struct Decided<'a> {
    /// Its job's index in the batch.
    job: usize,
    call: i64,
    held: HeldCall,
    finish: Finish<'a>,
}

impl Decided<'_> {
    /// Its escrow row: (lease, account).
    fn pot(&self) -> (i64, i64) {
        pot_of(&self.held)
    }

    /// Whether it debits its escrow row (a settle billed from it).
    fn debits(&self) -> bool {
        matches!(self.finish, Finish::Settled(_))
    }
}

async fn write_batch(escrow: &Escrow, jobs: &[EndJob]) -> Result<Vec<bool>, StoreError> {
    let _writer = escrow.writer.lock().await;
    let mut answers = vec![false; jobs.len()];
    // The jobs still to write, by index, and the rows read again after a failed guard.
    let mut pending: Vec<usize> = (0..jobs.len()).collect();
    let mut rows_read: HashMap<(i64, i64), Balance> = HashMap::new();
    while !pending.is_empty() {
        let (decided, debits) = decide(escrow, jobs, &pending, &rows_read);
        let short = match write_sql(&escrow.db, &decided, &debits).await {
            Ok(short) => short,
            Err(error) => {
                // The statement may have committed with its reply lost, this time or in an
                // earlier batch whose callers now retry (then this one failed on their ids).
                let Ok(written) = written_entries(&escrow.db, &decided).await else {
                    return Err(error);
                };
                if written.is_empty() {
                    return Err(error);
                }
                pending = finish_written(escrow, jobs, &decided, &written, &mut answers).await?;
                rows_read.clear();
                continue;
            }
        };
        {
            let mut state = escrow.state();
            // What was written: every row debited and the entries of its calls, and every
            // unbilled ending.
            for (pot_key, debited) in &debits {
                if short.contains(pot_key) {
                    continue;
                }
                let pot = state.pots.entry(*pot_key).or_default();
                let before = rows_read.remove(pot_key).unwrap_or(pot.row);
                pot.row = before.minus(*debited);
            }
            for (pot_key, row) in rows_read.drain() {
                state.pots.entry(pot_key).or_default().row = row;
            }
            pending.clear();
            for decided in &decided {
                if decided.debits() && short.contains(&decided.pot()) {
                    pending.push(decided.job);
                    continue;
                }
                if state.calls.remove(&decided.call).is_some() {
                    let pot = state.pots.entry(decided.pot()).or_default();
                    pot.held = pot.held.minus(decided.held.taken);
                }
                answers[decided.job] =
                    matches!(decided.finish, Finish::Settled(_) | Finish::Refunded(_));
            }
        }
        // Rows short of their debits (a lapse took their credits): read again and decide
        // their settles once more.
        for (lease, account) in short {
            let stored = escrow_row(&escrow.db, account, lease).await?;
            rows_read.insert((lease, account), stored);
        }
    }
    Ok(answers)
}

/// Settles and refunds whose entries are already written (`written`: call id to status), as
/// a batch whose reply was lost wrote them: each is answered by whether its entry is what it
/// asked for, no longer held, and its escrow row is read again (the lost batch debited it).
/// Returns the jobs left to write.
async fn finish_written(
    escrow: &Escrow,
    jobs: &[EndJob],
    decided: &[Decided<'_>],
    written: &HashMap<i64, String>,
    answers: &mut [bool],
) -> Result<Vec<usize>, StoreError> {
    let mut pending = Vec::new();
    let mut pots = Vec::new();
    {
        let mut state = escrow.state();
        for decided in decided {
            let Some(status) = written.get(&decided.call) else {
                pending.push(decided.job);
                continue;
            };
            let asked = match jobs[decided.job].ending {
                Ending::Settle(_) => CallStatus::Ok,
                Ending::Refund(_) => CallStatus::Refunded,
            };
            answers[decided.job] = status == asked.as_str();
            if state.calls.remove(&decided.call).is_some() {
                let pot = state.pots.entry(decided.pot()).or_default();
                pot.held = pot.held.minus(decided.held.taken);
            }
            pots.push(decided.pot());
        }
    }
    pots.sort_unstable();
    pots.dedup();
    for (lease, account) in pots {
        let row = escrow_row(&escrow.db, account, lease).await?;
        escrow.state().pots.entry((lease, account)).or_default().row = row;
    }
    Ok(pending)
}

/// Which of a batch's calls have an entry already, and its status.
async fn written_entries(
    db: &DatabaseConnection,
    decided: &[Decided<'_>],
) -> Result<HashMap<i64, String>, StoreError> {
    let list = decided
        .iter()
        .map(|decided| decided.call.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let rows = db
        .query_all_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "SELECT id, status FROM mg_calls WHERE id = ANY($1::bigint[])",
            [format!("{{{list}}}").into()],
        ))
        .await?;
    rows.iter()
        .map(|row| Ok((row.try_get_by_index(0)?, row.try_get_by_index(1)?)))
        .collect()
}

/// Writes a decided batch in one statement, so one round trip and one transaction, its text
/// the same whatever the batch's size (its rows passed as arrays), so that each connection
/// prepares it once: each escrow row's debit, guarded by its buckets, and the entries, finished,
/// of the settles on the rows debited and of every unbilled ending. Returns the (lease,
/// account) rows found short: neither they nor the entries of their settles were written.
#[cfg(feature = "postgres")]
async fn write_sql(
    db: &DatabaseConnection,
    decided: &[Decided<'_>],
    debits: &HashMap<(i64, i64), Split>,
) -> Result<Vec<(i64, i64)>, StoreError> {
    use sea_orm::sqlx;
    if decided.is_empty() {
        return Ok(Vec::new());
    }
    let (mut leases, mut accounts, mut subscription, mut topup) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for ((lease, account), debit) in debits {
        leases.push(*lease);
        accounts.push(*account);
        subscription.push(debit.subscription.0);
        topup.push(debit.topup.0);
    }
    let now = Utc::now();
    let mut rows = Entries::default();
    for decided in decided {
        rows.push(decided, now);
    }
    let (debited_leases, debited_accounts, inserted): (Option<Vec<i64>>, Option<Vec<i64>>, i64) =
        sqlx::query_as(
            "WITH debited AS ( \
               UPDATE mg_escrows e SET subscription_credits = e.subscription_credits - v.s, \
               topup_credits = e.topup_credits - v.t \
               FROM unnest($1::bigint[], $2::bigint[], $3::bigint[], $4::bigint[]) \
               AS v(l, a, s, t) \
               WHERE e.instance_id = v.l AND e.account_id = v.a \
               AND e.subscription_credits >= v.s AND e.topup_credits >= v.t \
               RETURNING e.instance_id, e.account_id \
             ), entered AS ( \
               INSERT INTO mg_calls (id, account_id, key_id, protocol, model, price, \
               charged_subscription, charged_topup, status, upstream_status, upstream_channel, \
               upstream_error, input_tokens, output_tokens, created_at, finished_at, \
               request_id, instance_id) \
               SELECT u.id, u.account_id, u.key_id, u.protocol, u.model, u.price, u.cs, u.ct, \
               u.status, u.upstream_status, u.upstream_channel, u.upstream_error, \
               u.input_tokens, u.output_tokens, u.created_at, u.finished_at, u.request_id, \
               u.instance_id \
               FROM unnest($5::bigint[], $6::bigint[], $7::bigint[], $8::text[], $9::text[], \
               $10::bigint[], $11::bigint[], $12::bigint[], $13::text[], $14::int[], \
               $15::text[], $16::text[], $17::bigint[], $18::bigint[], $19::timestamptz[], \
               $20::timestamptz[], $21::text[], $22::bigint[], $23::bool[]) \
               AS u(id, account_id, key_id, protocol, model, price, cs, ct, status, \
               upstream_status, upstream_channel, upstream_error, input_tokens, \
               output_tokens, created_at, finished_at, request_id, instance_id, debits) \
               WHERE NOT u.debits OR EXISTS (SELECT 1 FROM debited d \
                 WHERE d.instance_id = u.instance_id AND d.account_id = u.account_id) \
               RETURNING 1 \
             ) \
             SELECT (SELECT array_agg(instance_id) FROM debited), \
             (SELECT array_agg(account_id) FROM debited), (SELECT count(*) FROM entered)",
        )
        .bind(leases)
        .bind(accounts)
        .bind(subscription)
        .bind(topup)
        .bind(rows.id)
        .bind(rows.account)
        .bind(rows.key)
        .bind(rows.protocol)
        .bind(rows.model)
        .bind(rows.price)
        .bind(rows.subscription)
        .bind(rows.topup)
        .bind(rows.status)
        .bind(rows.upstream_status)
        .bind(rows.channel)
        .bind(rows.error)
        .bind(rows.input_tokens)
        .bind(rows.output_tokens)
        .bind(rows.created_at)
        .bind(rows.finished_at)
        .bind(rows.request_id)
        .bind(rows.instance)
        .bind(rows.debits)
        .fetch_one(db.get_postgres_connection_pool())
        .await
        .map_err(|error| StoreError(Box::new(error)))?;
    let debited: Vec<(i64, i64)> = debited_leases
        .unwrap_or_default()
        .into_iter()
        .zip(debited_accounts.unwrap_or_default())
        .collect();
    let short: Vec<(i64, i64)> = debits
        .keys()
        .filter(|pot| !debited.contains(pot))
        .copied()
        .collect();
    let expected = decided
        .iter()
        .filter(|decided| !(decided.debits() && short.contains(&decided.pot())))
        .count();
    if usize::try_from(inserted).ok() != Some(expected) {
        return Err(StoreError::msg(format!(
            "inserted {inserted} of {expected} call-log entries"
        )));
    }
    Ok(short)
}

#[cfg(not(feature = "postgres"))]
async fn write_sql(
    _: &DatabaseConnection,
    _: &[Decided<'_>],
    _: &HashMap<(i64, i64), Split>,
) -> Result<Vec<(i64, i64)>, StoreError> {
    Err(StoreError::msg("escrow needs PostgreSQL"))
}

/// A batch's entries, column by column.
#[cfg(feature = "postgres")]
#[derive(Default)]
struct Entries {
    id: Vec<i64>,
    account: Vec<i64>,
    key: Vec<i64>,
    protocol: Vec<&'static str>,
    model: Vec<String>,
    price: Vec<i64>,
    subscription: Vec<i64>,
    topup: Vec<i64>,
    status: Vec<&'static str>,
    upstream_status: Vec<Option<i32>>,
    channel: Vec<Option<String>>,
    error: Vec<Option<String>>,
    input_tokens: Vec<Option<i64>>,
    output_tokens: Vec<Option<i64>>,
    created_at: Vec<DateTime<Utc>>,
    finished_at: Vec<DateTime<Utc>>,
    request_id: Vec<Option<String>>,
    instance: Vec<Option<i64>>,
    debits: Vec<bool>,
}

#[cfg(feature = "postgres")]
impl Entries {
    fn push(&mut self, decided: &Decided<'_>, now: DateTime<Utc>) {
        let held = &decided.held;
        let billed = decided.finish.billed();
        self.id.push(decided.call);
        self.account.push(held.account);
        self.key.push(held.charge.caller.key.0);
        self.protocol.push(held.charge.protocol.as_str());
        self.model.push(held.charge.model.clone());
        self.price.push(held.charge.price.0);
        self.subscription.push(held.taken.subscription.0);
        self.topup.push(held.taken.topup.0);
        self.status.push(decided.finish.status().as_str());
        self.upstream_status.push(decided.finish.upstream_status());
        self.channel
            .push(billed.and_then(|success| success.channel.clone()));
        self.error.push(decided.finish.error().map(str::to_owned));
        self.input_tokens
            .push(billed.and_then(|success| success.usage.input_tokens));
        self.output_tokens
            .push(billed.and_then(|success| success.usage.output_tokens));
        self.created_at.push(held.reserved_at);
        self.finished_at.push(now);
        self.request_id.push(held.charge.request_id.clone());
        self.instance.push(held.charge.instance);
        self.debits.push(decided.debits());
    }
}

/// Decides each job in order against the rows in memory (or as read again): a settle whose
/// credits are still in the escrow debits it; one whose credits are gone ends unbilled.
fn decide<'a>(
    escrow: &Escrow,
    jobs: &'a [EndJob],
    pending: &[usize],
    rows_read: &HashMap<(i64, i64), Balance>,
) -> (Vec<Decided<'a>>, HashMap<(i64, i64), Split>) {
    let state = escrow.state();
    let mut rows: HashMap<(i64, i64), Balance> = HashMap::new();
    let mut debits: HashMap<(i64, i64), Split> = HashMap::new();
    let mut decided: Vec<Decided<'a>> = Vec::with_capacity(pending.len());
    for &index in pending {
        let job = &jobs[index];
        let Some(held) = state.calls.get(&job.call) else {
            continue;
        };
        if decided.iter().any(|done| done.call == job.call) {
            continue;
        }
        let pot_key = pot_of(held);
        let finish = match &job.ending {
            Ending::Refund(failure) => Finish::Refunded(failure),
            Ending::Settle(success) => {
                let row = rows.entry(pot_key).or_insert_with(|| {
                    rows_read
                        .get(&pot_key)
                        .copied()
                        .or_else(|| state.pots.get(&pot_key).map(|pot| pot.row))
                        .unwrap_or_default()
                });
                let after = row.minus(held.taken);
                if after.subscription.0 >= 0 && after.topup.0 >= 0 {
                    *row = after;
                    let debit = debits.entry(pot_key).or_default();
                    debit.subscription = Credits(debit.subscription.0 + held.taken.subscription.0);
                    debit.topup = Credits(debit.topup.0 + held.taken.topup.0);
                    Finish::Settled(success)
                } else {
                    Finish::CreditsGone(success)
                }
            }
        };
        decided.push(Decided {
            job: index,
            call: job.call,
            held: held.clone(),
            finish,
        });
    }
    (decided, debits)
}

/// Gives back to their accounts the escrow rows (of `account`, or of every account) whose
/// lease does not hold at `now` (its instance crashed, stopped without giving back, or lost its
/// lease), each in a transaction of its own. Returns how many rows it gave back. Recovery and a
/// recall may both run it at once: a row is read again under its lock, and one given back is
/// found empty.
pub(super) async fn give_back_ended(
    db: &DatabaseConnection,
    now: DateTime<Utc>,
    account: Option<i64>,
) -> Result<u64, StoreError> {
    let mut query = escrow::Entity::find()
        .select_only()
        .column(escrow::Column::AccountId)
        .column(escrow::Column::InstanceId)
        .filter(escrow::Column::InstanceId.not_in_subquery(super::leases::live(now)));
    if let Some(account) = account {
        query = query.filter(escrow::Column::AccountId.eq(account));
    }
    let ended: Vec<(i64, i64)> = query.into_tuple().all(db).await?;
    let mut given = 0;
    for (account, lease) in ended {
        let txn = super::begin_write(db).await?;
        // A lease that ended is never renewed, and its holder holds nothing that recovery
        // must leave: all of its escrow goes back.
        return_free(&txn, account, lease, Balance::default()).await?;
        txn.commit().await?;
        tracing::info!(account, lease, "gave back the escrow of a lease that ended");
        given += 1;
    }
    Ok(given)
}

/// What every escrow row holds, by account.
pub(super) async fn escrowed<C: ConnectionTrait>(
    db: &C,
    accounts: Option<&[i64]>,
) -> Result<HashMap<i64, Balance>, StoreError> {
    let mut query = escrow::Entity::find();
    if let Some(accounts) = accounts {
        query = query.filter(escrow::Column::AccountId.is_in(accounts.iter().copied()));
    }
    let mut sums: HashMap<i64, Balance> = HashMap::new();
    for row in query.all(db).await? {
        let sum = sums.entry(row.account_id).or_default();
        sum.subscription = Credits(sum.subscription.0 + row.subscription_credits);
        sum.topup = Credits(sum.topup.0 + row.topup_credits);
    }
    Ok(sums)
}
