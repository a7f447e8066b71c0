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
mod reserve;
mod rows;
mod state;

use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseConnection, DbBackend, EntityTrait, QueryFilter,
    Statement, TransactionTrait,
};
use tokio::sync::{mpsc, oneshot};

use super::entity::escrow;
use crate::credits::{Balance, Credits};
use crate::store::{AccountId, CallFailure, CallId, CallSuccess, LeaseId, StoreError};
use endings::write_endings;
use recalls::{answer_recalls, give_back_idle};
use reserve::read_keys;
pub(super) use rows::give_back_ended;
use rows::return_free;
pub use state::DEFAULT_ESCROW_IDLE;
pub(super) use state::Escrow;
use state::{EndJob, Ending, Pot, PotKey, RECALL_CHANNEL, RECALL_WAIT, stopped};

impl Escrow {
    /// Starts the key reader, the writer of endings and the look for idle escrow (every
    /// `idle`) on the current runtime; each ends with the last clone of the store.
    pub(super) fn start(
        db: DatabaseConnection,
        idle: std::time::Duration,
        events: Arc<super::alerting::EventSettings>,
    ) -> Arc<Escrow> {
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
            events,
        });
        tokio::spawn(read_keys(db, read_queue));
        tokio::spawn(write_endings(Arc::downgrade(&escrow), ending_queue));
        tokio::spawn(give_back_idle(Arc::downgrade(&escrow), idle));
        tokio::spawn(answer_recalls(Arc::downgrade(&escrow), stop_answering));
        escrow
    }

    /// Ends a held call: its entry is written, finished, in the next batch.
    async fn end(&self, call: CallId, ending: Ending) -> Result<bool, StoreError> {
        let (answer, answered) = oneshot::channel();
        let job = EndJob {
            call,
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
        // A cost above what the call holds is paid from the account as a whole: what it can
        // pay of the rest is moved into this instance's escrow first.
        let over = {
            let state = self.state();
            state.calls.get(&call).and_then(|held| {
                let over = success.cost?.minus(held.taken.total());
                (over > Credits::ZERO).then(|| (endings::pot_of(held), over))
            })
        };
        if let Some((pot, over)) = over {
            self.refill_for_settle(pot, over).await?;
        }
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
        lease: LeaseId,
        account: Option<AccountId>,
    ) -> Result<(), StoreError> {
        self.give_back_where(|pot, _| {
            pot.lease == lease && account.is_none_or(|account| account == pot.account)
        })
        .await?;
        Ok(())
    }

    /// Before the settle of `call`, reserved in the database rather than against escrow, at
    /// `cost`: if that is more than the call took, what this instance's escrow holds free for
    /// its account goes back to the account's row first, so that the settle takes what it
    /// needs beyond its reservation from the account as a whole (subscription credits first),
    /// as it would without escrow.
    pub(super) async fn free_for_database_settle(
        &self,
        call: CallId,
        cost: Credits,
    ) -> Result<(), StoreError> {
        use sea_orm::{EntityTrait, QuerySelect};
        let taken: Option<(i64, i64, i64)> = super::entity::call::Entity::find_by_id(call.0)
            .select_only()
            .column(super::entity::call::Column::AccountId)
            .column(super::entity::call::Column::ChargedSubscription)
            .column(super::entity::call::Column::ChargedTopup)
            .into_tuple()
            .one(&self.db)
            .await?;
        if let Some((account, subscription, topup)) = taken
            && cost > Credits::new(subscription + topup)
        {
            self.give_back_account(AccountId(account)).await?;
        }
        Ok(())
    }

    /// Gives back what this instance's escrow rows for `account` have free (under any lease);
    /// returns how many rows it gave back.
    async fn give_back_account(&self, account: AccountId) -> Result<usize, StoreError> {
        self.give_back_where(|key, pot| {
            key.account == account && pot.row.free_of(pot.held) != Balance::default()
        })
        .await
    }

    /// Gives back what the escrow rows that `pick` picks have free, one at a time (see
    /// [`give_back_pot`](Self::give_back_pot)); returns how many it picked.
    async fn give_back_where(
        &self,
        mut pick: impl FnMut(&PotKey, &mut Pot) -> bool,
    ) -> Result<usize, StoreError> {
        let pots: Vec<PotKey> = self
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
    /// refused for credits (`ours`: the account, and this instance's lease). Escrow under a
    /// lease that has ended (its instance crashed or lost it) is given back here and now, as
    /// recovery would give it back on its next round. The instances whose leases hold (other
    /// than this one's) are asked to give back what they have
    /// free, and the call waits until the credits they hold for it fall (a give-back, or a call
    /// of theirs ending), for at most [`RECALL_WAIT`]. `true`: credits came back, and the
    /// reservation may be tried again; `false`: none are held elsewhere, or none came back in
    /// time.
    async fn recall(&self, ours: PotKey) -> Result<bool, StoreError> {
        let now = Utc::now();
        // Never this instance's own rows under a lease it lost: its calls still hold them.
        let own: Vec<i64> = (self.state().pots.keys()).map(|pot| pot.lease.0).collect();
        if give_back_ended(&self.db, now, Some(ours.account), &own).await? > 0 {
            return Ok(true);
        }
        let before = self.escrowed_elsewhere(ours, now).await?;
        if before == 0 {
            return Ok(false);
        }
        self.db
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "SELECT pg_notify($1, current_schema() || ':' || $2::bigint::text)",
                [RECALL_CHANNEL.into(), ours.account.0.into()],
            ))
            .await?;
        let deadline = tokio::time::Instant::now() + RECALL_WAIT;
        let mut pause = std::time::Duration::from_millis(2);
        while tokio::time::Instant::now() + pause < deadline {
            tokio::time::sleep(pause).await;
            if self.escrowed_elsewhere(ours, now).await? < before {
                return Ok(true);
            }
            pause = Ord::min(pause * 2, std::time::Duration::from_millis(128));
        }
        Ok(false)
    }

    /// The credits escrow rows for `ours.account` hold under leases that hold at `now`, other
    /// than `ours.lease`.
    async fn escrowed_elsewhere(
        &self,
        ours: PotKey,
        now: DateTime<Utc>,
    ) -> Result<i64, StoreError> {
        let rows = escrow::Entity::find()
            .filter(escrow::Column::AccountId.eq(ours.account.0))
            .filter(escrow::Column::InstanceId.ne(ours.lease.0))
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
    async fn give_back_pot(&self, key: PotKey) -> Result<(), StoreError> {
        let _writer = self.writer.lock().await;
        let held = {
            let mut state = self.state();
            let Some(pot) = state.pots.get_mut(&key) else {
                return Ok(());
            };
            pot.writing = true;
            pot.held
        };
        let written = async {
            let txn = self.db.begin().await?;
            let kept = return_free(&txn, key, held).await?;
            txn.commit().await?;
            Ok::<_, StoreError>(kept)
        }
        .await;
        let mut state = self.state();
        let pot = state.pots.entry(key).or_default();
        pot.writing = false;
        pot.row = written?;
        if pot.row == Balance::default() && pot.held == Balance::default() {
            state.pots.remove(&key);
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
