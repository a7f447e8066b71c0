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

mod endings;
mod recalls;
mod rows;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use chrono::{DateTime, Utc};
use sea_orm::sea_query::{Expr, LockType};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseConnection, DbBackend, EntityTrait, QueryFilter,
    QuerySelect, Set, Statement, TransactionTrait,
};
use tokio::sync::{mpsc, oneshot};

use super::batch::Finish;
use super::entity::{account, escrow, instance};
use super::holds::HeldCall;
use super::writes::{OwnedCharge, unknown_account};
use crate::credits::{Balance, Credits, Split};
use crate::store::rules;
use crate::store::rules::holds;
use crate::store::{
    AccountId, CallFailure, CallId, CallStatus, CallSuccess, Reservation, ReserveError, StoreError,
};

use endings::{read_keys, write_endings};
#[cfg(feature = "postgres")]
use recalls::answer_recalls;
use recalls::give_back_idle;
use rows::{escrow_row, return_free, write_escrow_row};
pub(super) use rows::{escrowed, give_back_ended};

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
        pot.held = holds::hold(pot.held, taken);
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
    let pot = rules::escrow::Pot {
        row: pot.row,
        held: pot.held,
        writing: pot.writing,
        period_end: pot.period_end,
    };
    let account = rules::escrow::AccountRow {
        subscription: Credits(seen.row_subscription),
        subscription_ends_at: seen.subscription_ends_at,
    };
    rules::escrow::decide_pot_hold(pot, account, charge.at, charge.price).ok_or(Short::Credits)
}

fn stopped() -> StoreError {
    StoreError::msg("the store's escrow tasks have stopped")
}
