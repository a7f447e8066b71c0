//! Holding a call against the escrow: the key reader, then at once where the pot can pay,
//! after a refill where it cannot, and in the database where the account has too little for
//! escrow.

use std::collections::HashMap;

use chrono::Utc;

use sea_orm::sea_query::{Expr, LockType};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseConnection, DbBackend, EntityTrait, QueryFilter,
    QuerySelect, Statement, TransactionTrait,
};
use tokio::sync::{mpsc, oneshot};

use super::rows::{escrow_row, write_escrow_row};
use super::state::{
    Escrow, ID_BLOCK, KeyRead, MAX_BATCH, MAX_SLICE_CALLS, PotKey, REFILLED_SOON, Refill,
    SLICE_CALLS, Seen, Short, stopped, what_to_hold,
};
use crate::credits::{Balance, Credits};
use crate::store::rules::escrow::{Slice, refill};
use crate::store::rules::holds;
use crate::store::sea::alerting::threshold;
use crate::store::sea::commit::group_commit::Committer;
use crate::store::sea::entity::{account, instance, subscription_lapse};
use crate::store::sea::held::HeldCall;
use crate::store::sea::rows::balance_of;
use crate::store::sea::writes::{OwnedCharge, unknown_account};
use crate::store::{AccountId, CallId, Reservation, ReserveError, StoreError};

/// Where a call that escrow did not hold is to be reserved.
enum NotHeld {
    /// In the database: the account has too little for escrow (what this instance had free of
    /// it is back in its row), or this instance's lease has ended.
    InDatabase,
    /// In the database, as a keyed call is: its key has a spending limit, which the database
    /// write checks for every instance at once.
    Limited,
}

impl Escrow {
    /// Reserves `charge` against this instance's escrow under its lease, refilling the escrow
    /// when it cannot pay; else says where to reserve it.
    async fn reserve(
        &self,
        charge: &OwnedCharge,
        pot: PotKey,
    ) -> Result<Result<Reservation, NotHeld>, ReserveError> {
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
        if seen.limited {
            return Ok(Err(NotHeld::Limited));
        }
        let mut refilled = false;
        loop {
            match self.try_hold(charge, pot, seen) {
                Ok(reservation) => return Ok(Ok(reservation)),
                Err(Short::Ids) => self.fetch_ids().await?,
                Err(Short::Credits) if refilled => return Ok(Err(NotHeld::InDatabase)),
                Err(Short::Credits) => match self.refill(charge, pot, seen).await? {
                    Refill::Again => {}
                    Refill::Done { seen: after } => {
                        seen = after;
                        refilled = true;
                    }
                    // Its lease has ended (recovery may give the escrow back at any moment):
                    // reserve in the database until the store holds a new one.
                    Refill::LeaseEnded => return Ok(Err(NotHeld::InDatabase)),
                },
            }
        }
    }

    fn try_hold(
        &self,
        charge: &OwnedCharge,
        pot: PotKey,
        seen: Seen,
    ) -> Result<Reservation, Short> {
        let account = charge.caller.account.0;
        let mut state = self.state();
        let taken = what_to_hold(&state, charge, pot, seen)?;
        let id = state.ids.pop_front().ok_or(Short::Ids)?;
        let held_on = state.pots.entry(pot).or_default();
        held_on.held = holds::hold(held_on.held, taken);
        held_on.touched = true;
        let mut held = charge.clone();
        held.instance = Some(pot.lease);
        state.calls.insert(
            CallId(id),
            HeldCall {
                account: pot.account,
                charge: held,
                taken,
                reserved_at: Utc::now(),
            },
        );
        debug_assert!(
            state.sums_agree(),
            "what a pot holds is not the sum of its held calls"
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
        pot: PotKey,
        seen: Seen,
    ) -> Result<Refill, ReserveError> {
        let _writer = self.writer.lock().await;
        if what_to_hold(&self.state(), charge, pot, seen).is_ok() {
            return Ok(Refill::Again);
        }
        let (held, slice_calls) = {
            let mut state = self.state();
            let refilled = state.pots.entry(pot).or_default();
            refilled.writing = true;
            let slice_calls = match refilled.refilled {
                Some((at, calls)) if at.elapsed() < REFILLED_SOON => {
                    Ord::min(calls.saturating_mul(2), MAX_SLICE_CALLS)
                }
                _ => SLICE_CALLS,
            };
            (refilled.held, slice_calls)
        };
        let slice = Slice::Calls {
            price: charge.price,
            calls: slice_calls,
        };
        let written = self.write_refill(pot, held, charge.at, slice).await;
        let mut state = self.state();
        let refilled = state.pots.entry(pot).or_default();
        refilled.writing = false;
        let Some((row, seen)) = written? else {
            return Ok(Refill::LeaseEnded);
        };
        refilled.refilled = Some((std::time::Instant::now(), slice_calls));
        // Taken for a call about to hold on it: not idle, even if a look comes first.
        refilled.touched = true;
        refilled.row = row;
        refilled.period_end = seen.subscription_ends_at;
        refilled.last_lapse = seen.last_lapse;
        Ok(Refill::Done { seen })
    }

    /// Before a settle whose cost is `over` more than its call holds against `pot`: gives back
    /// what the escrow has free and takes what the account can pay of `over` in its place,
    /// subscription credits first, so that the settle pays from the account as a whole (as
    /// without escrow), not from this instance's slice of it alone.
    pub(super) async fn refill_for_settle(
        &self,
        pot: PotKey,
        over: Credits,
    ) -> Result<(), StoreError> {
        let _writer = self.writer.lock().await;
        let held = {
            let mut state = self.state();
            let refilled = state.pots.entry(pot).or_default();
            refilled.writing = true;
            refilled.held
        };
        let written = self
            .write_refill(pot, held, Utc::now(), Slice::Exactly(over))
            .await;
        let mut state = self.state();
        let refilled = state.pots.entry(pot).or_default();
        refilled.writing = false;
        match written {
            Ok(Some((row, seen))) => {
                refilled.touched = true;
                refilled.row = row;
                refilled.period_end = seen.subscription_ends_at;
                refilled.last_lapse = seen.last_lapse;
                Ok(())
            }
            // The lease ended: the settle pays from what the escrow holds.
            Ok(None) => Ok(()),
            Err(ReserveError::Store(error)) => Err(error),
            Err(other) => Err(StoreError::msg(format!("refilling for a settle: {other}"))),
        }
    }

    async fn write_refill(
        &self,
        pot: PotKey,
        held: Balance,
        at: chrono::DateTime<Utc>,
        slice: Slice,
    ) -> Result<Option<(Balance, Seen)>, ReserveError> {
        let txn = self.db.begin().await?;
        let row = account::Entity::find_by_id(pot.account.0)
            .lock(LockType::NoKeyUpdate)
            .one(&txn)
            .await?
            .ok_or_else(|| unknown_account(pot.account))?;
        let now = Utc::now();
        let live = instance::Entity::find_by_id(pot.lease.0)
            .filter(instance::Column::ExpiresAt.gt(now))
            .one(&txn)
            .await?
            .is_some();
        if !live {
            txn.rollback().await?;
            return Ok(None);
        }
        // Lapses write under the account's lock, held here: this is the last until commit.
        let last_lapse = subscription_lapse::Entity::find()
            .select_only()
            .column_as(subscription_lapse::Column::Id.max(), "last")
            .filter(subscription_lapse::Column::AccountId.eq(pot.account.0))
            .into_tuple::<Option<i64>>()
            .one(&txn)
            .await?
            .flatten()
            .unwrap_or(0);
        let stored = escrow_row(&txn, pot).await?;
        // What no held call counts on goes back to the row, then a new slice is taken from it.
        let free = stored.free_of(held);
        let pool = balance_of(&row).and(free);
        let spendable = pool.spendable(row.subscription_ends_at, at);
        // The account's low-balance threshold stays in its row, so that a balance falls below
        // it only through a reservation in the database, whose batch tells it.
        let keep = threshold(self.events.alerting(), row.low_balance_credits)
            .map_or(0, |threshold| threshold.0);
        let take = refill(spendable, Credits(keep), slice);
        let left = pool.minus(take);
        let escrowed = stored.less(free).plus(take);
        account::Entity::update_many()
            .col_expr(
                account::Column::SubscriptionCredits,
                Expr::value(left.subscription.0),
            )
            .col_expr(account::Column::TopupCredits, Expr::value(left.topup.0))
            .filter(account::Column::Id.eq(pot.account.0))
            .exec(&txn)
            .await?;
        write_escrow_row(&txn, pot, escrowed).await?;
        txn.commit().await?;
        let seen = Seen {
            row_subscription: left.subscription.0,
            subscription_ends_at: row.subscription_ends_at,
            last_lapse,
            // Read before the refill: a limited key never reaches it.
            limited: false,
        };
        Ok(Some((escrowed, seen)))
    }

    /// Reserves a call without an idempotency key: against this instance's escrow while it
    /// holds a lease; otherwise, or when the account has too little for escrow, in the
    /// database, and, if refused for credits there, once more after other instances gave back
    /// what their escrow holds free for the account.
    pub(in crate::store::sea) async fn reserve_or_in_database(
        &self,
        committer: &Committer,
        charge: OwnedCharge,
    ) -> Result<Reservation, ReserveError> {
        let Some(lease) = charge.instance else {
            return committer.reserve(charge).await;
        };
        let pot = PotKey::new(lease, charge.caller.account);
        match self.reserve(&charge, pot).await? {
            Ok(reservation) => return Ok(reservation),
            // Subscription credits this instance holds in escrow are spent first, as without
            // escrow: the way a keyed call is reserved.
            Err(NotHeld::Limited) => {
                return self
                    .reserve_keyed(&charge, || committer.reserve(charge.clone()))
                    .await;
            }
            Err(NotHeld::InDatabase) => {}
        }
        match committer.reserve(charge.clone()).await {
            Err(ReserveError::InsufficientCredits) if self.recall(pot).await? => {
                committer.reserve(charge).await
            }
            reserved => reserved,
        }
    }

    /// Reserves a keyed call, which is reserved in the database, with `reserve`: subscription
    /// credits in this instance's escrow go back first, to be spent before the row's top-up
    /// credits; a call refused for credits gives back what is free here and is tried once
    /// more, then recalls other instances' (an escrow instance owns no file, so nothing is
    /// frozen while they are recalled).
    pub(in crate::store::sea) async fn reserve_keyed<F, Fut>(
        &self,
        charge: &OwnedCharge,
        reserve: F,
    ) -> Result<Reservation, ReserveError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<Reservation, ReserveError>>,
    {
        let Some(lease) = charge.instance else {
            return reserve().await;
        };
        let pot = PotKey::new(lease, charge.caller.account);
        if self.has_free_subscription(pot) {
            self.give_back(pot.lease, Some(pot.account)).await?;
        }
        let mut reserved = reserve().await;
        if let Err(ReserveError::InsufficientCredits) = reserved {
            self.give_back(pot.lease, Some(pot.account)).await?;
            reserved = reserve().await;
            if let Err(ReserveError::InsufficientCredits) = reserved
                && self.recall(pot).await?
            {
                reserved = reserve().await;
            }
        }
        reserved
    }
}

/// The key reader: each read answers every reservation that was waiting when it began.
pub(super) async fn read_keys(db: DatabaseConnection, mut queue: mpsc::Receiver<KeyRead>) {
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

pub(super) async fn active_keys(
    db: &DatabaseConnection,
    keys: &[i64],
) -> Result<HashMap<i64, Seen>, StoreError> {
    let list = keys
        .iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let sql = "SELECT k.id, a.subscription_credits, a.subscription_ends_at, \
               k.limit_credits IS NOT NULL, \
               COALESCE((SELECT max(l.id) FROM mg_subscription_lapses l \
                         WHERE l.account_id = a.id), 0) \
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
                limited: row.try_get_by_index(3)?,
                last_lapse: row.try_get_by_index(4)?,
            },
        );
    }
    Ok(seen)
}
